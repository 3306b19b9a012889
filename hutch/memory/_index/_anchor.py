"""Turns answer where turns are: in a store of conversation turns, an entity within one link of a turn is
searched through its turns, not beside them.

In a store that holds conversation turns (units with an anchor and a speaker), a question is nearly always
answered by what someone said. An entity of one unit that is not a turn but hangs off the conversation (a
person, a day, an event summary: each linked to or from a session) matched questions as well as the turn
that says it, took places in the top k from it, and changed how every channel scales its scores (the API's
defaults trailed `classes=["interactions"]` by 10 points of R@5 on LoCoMo, docs/retrieval.md). The rule, in
terms of the store's structure only (no class names):

- when the candidates hold turns, a unit that is not a turn and whose entity is linked (either direction)
  to an entity with candidate turns is not a candidate of its own: its turns are, so a question whose answer
  that entity holds is answered by its best turn (deduplicated: one hit, the turn);
- every channel, and the second stage, then sees exactly the units it would see if the caller had named
  the turns' classes (`classes=`): the defaults rank the turns as the bench's settings do, by construction;
- a unit linked to no candidate turn (a note of its own, a person no conversation names) stays a candidate;
  a store or a filter without turns is left as it is (a store of notes ranks exactly as before).

The alternative, carrying the entity's score onto its best turn (the turn moved up to where the entity
ranked), lost R@5 in every LoCoMo conversation when this was written (those figures were not recorded);
this rule's: docs/retrieval.md, "Sixth round".
"""

from __future__ import annotations

import numpy as np

from hutch.memory._index import _rank


def turn_side(snap: _rank.Snapshot, db, mask: np.ndarray) -> np.ndarray:
    """The candidate mask without the units that are searched through their turns (see the module)."""
    n = snap.n
    turns = snap.is_turn[:n] & mask
    if not turns.any() or turns.sum() == mask.sum():
        return mask
    src, dst = _pairs(snap, db)
    if not len(src):
        return mask
    # an entity has candidate turns: its linked non-turn entities are searched through them
    has = np.zeros(snap.ne, bool)
    has[snap.epos[:n][turns]] = True
    reach = np.zeros(snap.ne, bool)
    reach[src[has[dst]]] = True
    return mask & (snap.is_turn[:n] | ~reach[snap.epos[:n]])


def _pairs(snap: _rank.Snapshot, db) -> tuple[np.ndarray, np.ndarray]:
    """(entity without turns, entity with turns) for every link between two such entities, either direction, as
    entity positions; kept per index generation (one read of the links of the entities that have turns)."""
    key = ("turn-links", snap.gen, snap.n, len(snap.upos), snap.ne)
    got = snap.memo.get(key)
    if got is not None:
        return got
    n = snap.n
    alive = snap.alive[:n]
    with_turns = np.zeros(snap.ne, bool)
    with_turns[snap.epos[:n][alive & snap.is_turn[:n]]] = True
    ids = [snap.entity_id[e] for e in np.flatnonzero(with_turns)]
    src: list[int] = []
    dst: list[int] = []
    for chunk in _rank.batches(ids):
        marks = ",".join("?" * len(chunk))
        for a, b in db.execute(f"select src, dst from links where src in ({marks}) union all "
                               f"select dst, src from links where dst in ({marks})", chunk + chunk):
            # a: an entity with turns, b: the other end
            pa, pb = snap.pos_of_id.get(a), snap.pos_of_id.get(b)
            if pa is not None and pb is not None and not with_turns[pb]:
                src.append(pb)
                dst.append(pa)
    got = (np.asarray(src, np.int64), np.asarray(dst, np.int64))
    if len(snap.memo) >= 256:
        snap.memo.clear()
    snap.memo[key] = got
    return got


def conversations(snap: _rank.Snapshot) -> np.ndarray:
    """(units,) which conversation each turn is of (0, 1, ...; -1 for a unit that is not a turn): the entities
    with turns (sessions) whose turns have the same speakers are one conversation, so a store holding several
    ingested conversations reads each one's relative time words from its own end (_search.SearchIndex.
    _turn_references). From the store's structure only (speakers, not ids or classes); kept per index
    generation."""
    key = ("conversations", snap.gen, snap.n, len(snap.upos), snap.ne)
    got = snap.memo.get(key)
    if got is not None:
        return got
    n = snap.n
    out = np.full(n, -1, np.int64)
    idx = np.flatnonzero(snap.alive[:n] & snap.is_turn[:n])
    if len(idx):
        ent, spk = snap.epos[:n][idx], snap.speaker[:n][idx]
        base = int(spk.max()) + 2
        pairs = np.unique(ent * base + (spk + 1))  # (entity, speaker) once each, sorted by entity
        speakers: dict[int, list[int]] = {}
        for e, sp in zip((pairs // base).tolist(), (pairs % base).tolist()):
            speakers.setdefault(e, []).append(sp)
        number: dict[tuple[int, ...], int] = {}
        of = {e: number.setdefault(tuple(v), len(number)) for e, v in speakers.items()}
        lut = np.full(snap.ne, -1, np.int64)
        lut[list(of)] = list(of.values())
        out[idx] = lut[ent]
    if len(snap.memo) >= 256:
        snap.memo.clear()
    snap.memo[key] = out
    return out
