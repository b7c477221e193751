import sys

from turbine.mocker.worker import main

if __name__ == "__main__":
    sys.exit(main())
