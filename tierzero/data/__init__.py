"""Training data for `tierzero train`: byte-level text, or tokenized documents packed into sequences.

sources.py finds the files `data.path` names and reads their documents (text, JSON
Lines, a saved `datasets` directory); tokenizer.py loads `data.tokenizer` and checks the
model's vocabulary against it; tokens.py tokenizes once into a memory-mapped cache;
packing.py cuts the stream into shuffled fixed-length sequences (PackedBatches);
bytes.py is the byte-level path (ByteBatches) used when data.tokenizer is null;
batches.py holds the `Batches` protocol both follow and `batches_from_config`.
"""

from tierzero.data.batches import Batches, batches_from_config
from tierzero.data.bytes import ByteBatches, ByteCorpus, load_corpus
from tierzero.data.packing import PackedBatches
from tierzero.data.sources import Format, Source, find_files, find_sources, read_documents, stdlib_dir, stdlib_sources
from tierzero.data.tokenizer import TextTokenizer, check_vocab, load_tokenizer
from tierzero.data.tokens import TokenStream, default_cache_dir, token_stream

__all__ = [
    "Batches",
    "ByteBatches",
    "ByteCorpus",
    "Format",
    "PackedBatches",
    "Source",
    "TextTokenizer",
    "TokenStream",
    "batches_from_config",
    "check_vocab",
    "default_cache_dir",
    "find_files",
    "find_sources",
    "load_corpus",
    "load_tokenizer",
    "read_documents",
    "stdlib_dir",
    "stdlib_sources",
    "token_stream",
]
