"""What the samples are: the manifest (dense ids, locations, labels), scanning a URI into one,
and the packed Parquet format. Imports ``storage`` and ``image`` (never a stage above)."""
