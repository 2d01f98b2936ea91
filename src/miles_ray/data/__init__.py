"""A user's own datasets as data sources (``DatasetSource``), and the readers behind them."""

from miles_ray.data.files import read_rows, rows_of
from miles_ray.data.source import DataExhausted, DatasetSource, DatasetSourceConfig

__all__ = ["DataExhausted", "DatasetSource", "DatasetSourceConfig", "read_rows", "rows_of"]
