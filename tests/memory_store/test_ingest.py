"""Ingest of the LoCoMo dev conversations and of Markdown documents, on real files and git."""

import json

import pytest

import hutch
from hutch._core import settings

DATA = settings.LOCOMO_DIR.get()
CONV = DATA / "conv-26.json"
needs_data = pytest.mark.skipif(not CONV.exists(), reason=f"{CONV} is not on this machine")

SMALL = {
    "speaker_a": "Ann", "speaker_b": "Ben",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [
        {"speaker": "Ann", "dia_id": "D1:1", "text": "Hi Ben! # not a heading"},
        {"speaker": "Ben", "dia_id": "D1:2", "text": "# looks like a heading\nsecond line",
         "blip_caption": "a photo of a dog", "img_url": ["http://example.invalid/x.jpg"]},
    ],
    "session_2_date_time": "9:00 am on 9 May, 2023",
    "session_2": [],
    "events_session_1": {"Ann": ["Ann adopts a dog."], "Ben": [], "date": "8 May, 2023"},
    "qa": [{"question": "q", "answer": "a", "evidence": ["D1:1"], "category": 1}],
}


def test_small_conversation_layout(mem, store_dir):
    r = mem.ingest_conversation(SMALL, conv_id="t-1")
    s = mem.get("interactions/t-1-session-1")
    assert s.meta["valid_from"] == "2023-05-08T13:56:00"
    assert s.meta["session_date"] == "1:56 pm on 8 May, 2023"
    assert s.meta["participants"] == ["Ann", "Ben"]
    assert s.source == "locomo:t-1#session-1"
    assert s.section("D1:1") == "Hi Ben! # not a heading"
    assert s.section("D1:2") == "\\# looks like a heading\nsecond line\n\n> [image: a photo of a dog]"
    assert "### D1:2 · Ben" in s.body
    assert [e.id for e in s.links["participants"]] == ["actors/ann", "actors/ben"]
    assert s.link_ids["on_date"] == ("time/2023-05-08",)
    ev = mem.get("events/t-1-session-1-event-1")
    assert ev.body.strip() == "Ann adopts a dog." and ev.valid_from == "2023-05-08"
    assert ev.link_ids == {"about": ("actors/ann",), "in_session": ("interactions/t-1-session-1",),
                           "on_date": ("time/2023-05-08",)}
    assert not mem.exists("interactions/t-1-session-2")  # empty sessions are skipped
    assert r.count == len(mem.ls()) == 5
    assert mem.git.log(limit=1)[0].trailer("Hutch-Op") == "ingest"
    assert "qa" not in (store_dir / "interactions" / "t-1-session-1.md").read_text().lower().split()
    assert mem.check().ok


def test_reingest_changes_nothing(mem):
    mem.ingest_conversation(SMALL, conv_id="t-1")
    head = mem.git.run("rev-parse", "HEAD")
    r = mem.ingest_conversation(json.dumps(SMALL), conv_id="t-1")
    assert r.commit is None and mem.git.run("rev-parse", "HEAD") == head


def test_bad_conversation_input_is_a_clear_error(mem):
    with pytest.raises(hutch.ConfigError, match="sessions"):
        mem.ingest_conversation({"speaker_a": "x"}, conv_id="c")
    with pytest.raises(hutch.ConfigError, match="dia_id"):
        mem.ingest_conversation({"session_1": [{"text": "no speaker"}]}, conv_id="c")
    assert mem.ls() == []


@needs_data
def test_locomo_dev_conversation(mem):
    raw = json.loads(CONV.read_text())
    r = mem.ingest_conversation(CONV)
    sessions = [k for k, v in raw.items() if k.startswith("session_") and k.count("_") == 1 and v]
    assert len(r.entities["interactions"]) == len(sessions)
    # every turn is addressable by its dia_id and carries its image caption
    for k in sessions:
        n = k.split("_")[1]
        e = mem.get(f"interactions/conv-26-session-{n}")
        for t in raw[k]:
            text = e.section(t["dia_id"])
            assert text is not None and t["text"].splitlines()[0].lstrip("#") in text
            if t.get("blip_caption"):
                assert f"[image: {t['blip_caption']}]" in text
    assert mem.ls("actors") == ["actors/caroline", "actors/melanie"]
    assert mem.check().ok


DOC = """# Runbook

Intro text.

## Deploy

Run the deploy.

### Rollback

Undo it.

```
## not a heading (code)
```

## Monitor

Watch graphs.
"""


def test_ingest_text_splits_along_headings(mem, tmp_path):
    p = tmp_path / "runbook.md"
    p.write_text(DOC)
    r = mem.ingest_text(p)
    assert r.entities["documents"] == ["documents/runbook", "documents/runbook--deploy", "documents/runbook--monitor"]
    doc = mem.get("documents/runbook")
    deploy = mem.get("documents/runbook--deploy")
    assert "Intro text." in doc.body
    assert deploy.body.lstrip("\n").startswith("## Deploy") and "### Rollback" in deploy.body
    assert "## not a heading (code)" in deploy.body
    assert deploy.link_ids == {"next": ("documents/runbook--monitor",), "part_of": ("documents/runbook",)}
    assert deploy.source == f"file:{p}#Deploy"
    assert deploy.section("Rollback") == "Undo it.\n\n```\n## not a heading (code)\n```"
    again = mem.ingest_text(p)
    assert again.commit is None


def test_ingest_plain_text_string(mem):
    r = mem.ingest_text("just a note\nwith two lines", title="Note", cls="notes")
    assert r.entities == {"notes": ["notes/note"]}
    assert mem.get("notes/note").body.strip() == "just a note\nwith two lines"
