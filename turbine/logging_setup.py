import logging
import os


def setup_logging() -> None:
    level = os.environ.get("TURBINE_LOG", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
