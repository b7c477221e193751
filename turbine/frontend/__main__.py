import sys

from turbine.frontend.server import main

if __name__ == "__main__":
    sys.exit(main())
