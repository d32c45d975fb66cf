"""anabranch: elastic, key-ordered, transactional streams for Python."""

__version__ = "0.1.0"
