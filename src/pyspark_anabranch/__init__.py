"""PySpark data source for anabranch scalable topics (placeholder while it is built)."""
