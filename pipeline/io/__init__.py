"""Input and output: reading input tables, checking rows and the model, the output directory (Parquet
parts, job record, lock) and the reference corpora's n-gram indexes."""
