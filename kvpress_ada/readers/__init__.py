"""Read policies (``Pipeline.reader``): the pages of the kept cache each decode step reads."""

from .base import READERS, Reader, register_reader
from .top_pages import TopPages, row_pages

__all__ = ["READERS", "Reader", "register_reader", "TopPages", "row_pages"]
