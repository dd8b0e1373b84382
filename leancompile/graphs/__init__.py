"""Graph capture, printing, diffing and the reports ``explain`` returns."""

from .printing import graph_code, op_count_diff, op_counts
from .report import GraphRecord, Report, last_report

__all__ = ["graph_code", "op_counts", "op_count_diff", "GraphRecord", "Report", "last_report"]
