"""Where an SCD code store keeps its entries: bytes by key, behind a small protocol.

:class:`StoreBackend` is what :class:`~hf_kvcodecs.scd.code_store.SCDCodeStore` needs: ``put`` / ``get`` / ``exists``
/ ``delete`` of bytes by key, the size of one entry before it is read (so a read is bounded before it allocates)
and the bytes held in all. Two come with the package:

- :class:`DirectoryBackend` (the default): one file per entry in a directory, written to a temporary name and renamed
  into place, so a reader never sees half an entry.
- :class:`RedisBackend`: any Redis-compatible server through the ``redis`` client (``pip install
  hf_kvcodecs[redis]``), entries under one key prefix; the size is ``STRLEN`` before ``GET``.

Other stores plug in the same way. LMCache's storage backends, for instance, move opaque blobs by key (its
local-disk, Redis and remote connectors); an adapter that implements these six methods over such a connector would
hold SCD code entries instead of raw KV chunks, with no change to the store. (Not built here.)

Keys are checked against one pattern (lower-case letters, digits, ``.``, ``_`` and ``-``, at most 240 characters), so
a key can never name a path outside the directory or a different Redis namespace.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["DirectoryBackend", "RedisBackend", "StoreBackend", "StoreError", "check_key"]

_KEY = re.compile(r"[a-z0-9][a-z0-9._-]{0,239}")
_SUFFIX = ".safetensors"


class StoreError(ValueError):
    """An entry that is missing, too large, corrupt or not the one asked for; or a backend that cannot be used."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or ".." in key:
        raise StoreError(f"Store keys are lower-case letters, digits, '.', '_' and '-' (at most 240 characters, no "
                         f"'..'); got {str(key)[:60]!r}.")
    return key


@runtime_checkable
class StoreBackend(Protocol):
    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The entry's bytes, None when there is none; refuses (StoreError) an entry over ``max_bytes`` before
        reading it."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """True when an entry was deleted."""

    def size(self, key: str) -> int | None:
        """The entry's size in bytes, None when there is none."""

    def total_bytes(self) -> int:
        """Bytes held by every entry of this store."""


class DirectoryBackend:
    """Entries as files ``<key>.safetensors`` in ``directory`` (created when missing)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{check_key(key)}{_SUFFIX}"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".incoming-", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def get(self, key: str, max_bytes: int) -> bytes | None:
        path = self._path(key)
        try:
            with path.open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size > max_bytes:
                    raise StoreError(f"Store entry {key[:40]}... holds {size} bytes, over the {max_bytes} this read "
                                     "allows; raise max_entry_bytes if the entry is expected to be that large.")
                data = file.read(max_bytes + 1)
        except FileNotFoundError:
            return None
        if len(data) > max_bytes:
            raise StoreError(f"Store entry {key[:40]}... grew past {max_bytes} bytes while it was read.")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.directory.glob(f"*{_SUFFIX}") if _KEY.fullmatch(path.stem))


class RedisBackend:
    """Entries as Redis strings ``<prefix><key>`` on a Redis-compatible server (``redis`` client, imported here)."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, prefix: str = "hf_kvcodecs:scd:", client=None):
        if client is None:
            try:
                import redis
            except ImportError as error:
                raise StoreError("RedisBackend needs the redis client: pip install 'hf_kvcodecs[redis]' (or "
                                 "pip install redis).") from error
            client = redis.Redis.from_url(url)
        if not re.fullmatch(r"[A-Za-z0-9:._-]{1,64}", prefix):
            raise StoreError(f"The Redis key prefix must be 1-64 letters, digits, ':', '.', '_' or '-'; got "
                             f"{prefix[:70]!r}.")
        self.client, self.prefix = client, prefix

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        self.client.set(self._name(key), bytes(data))

    def get(self, key: str, max_bytes: int) -> bytes | None:
        name = self._name(key)
        size = int(self.client.strlen(name))
        if size > max_bytes:
            raise StoreError(f"Store entry {key[:40]}... holds {size} bytes, over the {max_bytes} this read allows; "
                             "raise max_entry_bytes if the entry is expected to be that large.")
        # GETRANGE reads at most max_bytes + 1 even if the value grew since STRLEN
        data = self.client.getrange(name, 0, max_bytes) if size else self.client.get(name)
        if data is None or (not data and not self.client.exists(name)):
            return None
        if len(data) > max_bytes:
            raise StoreError(f"Store entry {key[:40]}... grew past {max_bytes} bytes while it was read.")
        return bytes(data)

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self._name(key)))

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(self._name(key)))

    def size(self, key: str) -> int | None:
        name = self._name(key)
        return int(self.client.strlen(name)) if self.client.exists(name) else None

    def total_bytes(self) -> int:
        return sum(int(self.client.strlen(name)) for name in self.client.scan_iter(match=f"{self.prefix}*"))
