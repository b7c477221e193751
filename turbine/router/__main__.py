import sys

from turbine.router.service import main

if __name__ == "__main__":
    sys.exit(main())
