"""Shared helpers of the search-index tests (a module with a unique name: every test directory has its own
conftest.py, so `from conftest import ...` would pick up whichever was imported first)."""

import subprocess
from pathlib import Path


def git(store: Path, *args: str) -> str:
    """Run git in the store (argv, no shell); returns stdout."""
    r = subprocess.run(["git", "-C", str(store), *args], capture_output=True, text=True, check=True,
                       env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@localhost", "PATH": "/usr/bin:/bin", "HOME": str(store)})
    return r.stdout


CONVERSATION = {
    "speaker_a": "Nadia",
    "speaker_b": "Tomas",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [
        {"speaker": "Nadia", "dia_id": "D1:1", "text": "Hi Tomas! How was your week?"},
        {"speaker": "Tomas", "dia_id": "D1:2", "text": "Busy. I started restoring an old sailing boat I bought."},
        {"speaker": "Nadia", "dia_id": "D1:3", "text": "I adopted a puppy from the shelter yesterday, a beagle!",
         "blip_caption": "a photo of a small dog on a couch"},
        {"speaker": "Tomas", "dia_id": "D1:4", "text": "That is lovely, what did you name him?"},
        {"speaker": "Nadia", "dia_id": "D1:5", "text": "His name is Biscuit."},
    ],
    "session_2_date_time": "10:00 am on 20 June, 2023",
    "session_2": [
        {"speaker": "Tomas", "dia_id": "D2:1", "text": "The boat is finally in the water, we sailed to the island."},
        {"speaker": "Nadia", "dia_id": "D2:2", "text": "Amazing! I have been training for a marathon in October."},
        {"speaker": "Tomas", "dia_id": "D2:3", "text": "Running that far sounds exhausting."},
    ],
    "qa": [],
}
