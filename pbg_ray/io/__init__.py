"""File formats and storage, local or on object storage; never the model or Ray.

storage.py           paths and URIs through pyarrow.fs, v1 HDF5 helpers
files.py             atomic writes, reading with errors that name the file, locks
edges.py             edge buckets edges_{lhs}_{rhs}.h5, read chunk by chunk
entities.py          entity counts, names and relation names
raw.py               raw edge tables (TSV, CSV, Parquet) in Arrow record batches
embedding_tables.py  exported embeddings as TSV or Parquet
"""
