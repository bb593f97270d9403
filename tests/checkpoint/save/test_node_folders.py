"""What a node's local tier holds of a run (harness/checkpoint/save/node_folders.py): every rank's and
peer folder, whoever wrote it, and a name for the storage behind them that any path to it gives."""

import torch

from harness.checkpoint.save.node_folders import LOCAL, PEER, disk_id, folders, local_store, peer_store
from harness.config import LocalTierSection


def test_every_rank_and_peer_folder_of_the_run_is_listed_with_its_owner(tmp_path):
    section = LocalTierSection(dir=str(tmp_path), every_steps=2)
    for store in (local_store(section, "run-a", 3), local_store(section, "run-a", 0), peer_store(section, "run-a", 1),
                  local_store(section, "run-b", 2)):
        store.save(2, {"model": torch.nn.Linear(2, 2)})
    (tmp_path / "run-a" / "notes").mkdir()
    found = folders(section, "run-a")
    assert [(f.name, f.owner, f.tier) for f in found] == [("peer-of-rank-00001", 1, PEER), ("rank-00000", 0, LOCAL),
                                                          ("rank-00003", 3, LOCAL)]
    assert [ref.step for f in found for ref in f.store.list()] == [2, 2, 2]
    assert folders(section, "run-c") == []


def test_the_disk_id_is_made_once_and_found_through_any_path_to_the_folder(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk")
    section, same = (LocalTierSection(dir=str(tmp_path / name), every_steps=2) for name in ("disk", "link"))
    other = LocalTierSection(dir=str(tmp_path / "other"), every_steps=2)
    made = disk_id(section, "run-a")
    assert disk_id(section, "run-a") == disk_id(same, "run-a") == made
    assert disk_id(other, "run-a") != made
    assert [p.name for p in (tmp_path / "disk" / "run-a").iterdir()] == ["disk-id"]
