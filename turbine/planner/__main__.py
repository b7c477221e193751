import sys

from turbine.planner.service import main

if __name__ == "__main__":
    sys.exit(main())
