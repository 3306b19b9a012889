"""The derived search index of an SMF store: SQLite (FTS5 BM25, vectors, links, time) under <store>/.hutch/.

Public names are exported from `hutch` (not from hutch.memory): `Hit`, `IndexReport`,
`EmbeddingProvider`, `MiniLMProvider`, `OpenAIEmbeddings`, `OpenAIReasoner`. The method and
its measurements are in docs/retrieval.md.
"""

from hutch.memory._index._embed import EmbeddingProvider, MiniLMProvider, OpenAIEmbeddings, default_provider
from hutch.memory._index._reason import OpenAIReasoner
from hutch.memory._index._search import Hit, IndexReport, SearchIndex

__all__ = ["EmbeddingProvider", "Hit", "IndexReport", "MiniLMProvider", "OpenAIEmbeddings", "OpenAIReasoner",
           "SearchIndex",
           "default_provider"]
