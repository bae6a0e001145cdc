"""The sharded token store: pretraining corpora tokenized by a datatrove pipeline of N tasks into
shards (tokens, document index, sidecar) plus a manifest, read memory-mapped while training.

`build_token_store` writes it (`lmforge prepare CONFIG --executor local|slurm|ray`);
`open_token_store` checks it against the run and opens it as block datasets.
"""

from lmforge.data.token_store.build import build_token_store
from lmforge.data.token_store.dataset import StoreBlocks
from lmforge.data.token_store.store import TokenStoreData, open_token_store

__all__ = ["StoreBlocks", "TokenStoreData", "build_token_store", "open_token_store"]
