"""The sharded token store: pretraining corpora tokenized by a datatrove pipeline of N tasks into
shards (tokens, document index, sidecar) plus a manifest, read memory-mapped while training.

`build.build_token_store` writes it (`lmforge prepare CONFIG --executor local|slurm|ray`);
`store.open_token_store` checks it against the run and opens it as block datasets. This package
file imports nothing: a store task loads `pipeline` alone, without torch or transformers.
"""
