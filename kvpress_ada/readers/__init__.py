"""Read policies (``Pipeline.reader``): the pages of the kept cache each decode step reads."""

from .base import READERS, Reader, register_reader, select_pages
from .top_pages import TopPages, row_pages

__all__ = ["READERS", "Reader", "register_reader", "select_pages", "TopPages", "row_pages"]
