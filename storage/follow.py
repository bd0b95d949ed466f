"""Cutting a file along its parent checkpoint's chunk boundaries, proving each one by its hash.

An incremental push re-reads every byte of the new image, but most of it is where it was in
the parent checkpoint. FastCDC decides a cut from the chunk's own bytes only (the rolling
hash starts afresh at each cut), so a chunk that starts at a cut and whose bytes hash to the
parent's chunk id ends exactly where content-defined chunking would end it. Following the
parent therefore gives the very cuts FastCDC would give, at the cost of the hash alone (which
the push needs anyway), instead of a scan and a hash per byte.

Where a chunk does not match (its bytes changed, or pages were inserted before it), cutting
falls back to FastCDC from that chunk's start and hashes what it cuts; as soon as a cut chunk
is one the parent has (FastCDC resynchronises a chunk or two after a change), following
resumes after it. The only extra cost is one wasted hash per changed region.

The parent is only a hint: every id yielded is the hash of the bytes yielded, so a wrong,
stale or hostile parent can cost time, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from gpusnap.storage.chunker import Chunker
from gpusnap.storage.manifest import ChunkRef

ChunkIdFn = Callable[[memoryview], str]


def cut_following(
    view: memoryview, chunker: Chunker, parent: Sequence[ChunkRef], chunk_id: ChunkIdFn
) -> Iterator[tuple[int, int, str]]:
    """``(offset, length, id)`` of every chunk of ``view``, each id the hash of those bytes."""
    size = len(view)
    where: dict[str, int] = {}
    for i, ref in enumerate(parent):
        where.setdefault(ref.id, i)
    last = len(parent) - 1
    max_size = chunker.params.max_size
    pos = 0
    nxt = 0 if parent else -1  # the parent chunk expected at ``pos``; -1: not following
    while pos < size:
        if 0 <= nxt <= last:
            ref = parent[nxt]
            end = pos + ref.size
            # The parent's last chunk ended at its file's end, which is a cut only if this
            # file ends there too; no chunk is longer than the chunker's maximum.
            if 0 < ref.size <= max_size and end <= size and (nxt < last or end == size):
                cid = chunk_id(view[pos:end])
                if cid == ref.id:
                    yield pos, ref.size, cid
                    pos = end
                    nxt += 1
                    continue
        nxt = -1
        for offset, length in chunker.cut(view[pos:]):
            start = pos + offset
            cid = chunk_id(view[start : start + length])
            yield start, length, cid
            found = where.get(cid)
            if found is not None and found < last:
                pos = start + length
                nxt = found + 1
                break
        else:
            pos = size
