"""Models, their layers and weights. Importing the package loads nothing heavy: the tokenizer and the
CLI read `source` without paying for torch."""
