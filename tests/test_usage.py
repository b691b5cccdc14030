"""dualend.ops.usage: tokens per key and day in SQLite, read back after a restart; the daily quota."""
import pytest

from dualend.ops.api_keys import ApiKey, KeysFileError, read_keys
from dualend.ops.openai_api.app import Service, ServiceSettings
from dualend.ops.openai_api.translation import ApiError
from dualend.ops.usage import UsageStore, main, seconds_to_next_day, today


def test_usage_adds_up_per_key_and_day_and_survives_a_restart(tmp_path, capsys):
    store = UsageStore(tmp_path / "usage.sqlite")
    store.record("alice", 10, 0, 5)
    store.record("alice", 7, 3, 2)
    store.record("bob", 1, 0, 1)
    store.record("alice", 100, 0, 100, day="2026-01-01")
    store.close()
    again = UsageStore(tmp_path / "usage.sqlite")  # a new process would open it the same way
    assert again.tokens("alice") == 10 + 5 + 7 + 2 and again.tokens("bob") == 2 and again.tokens("carol") == 0
    assert again.tokens("alice", "2026-01-01") == 200
    assert again.rows()[:2] == [(today(), "alice", 2, 17, 3, 7), (today(), "bob", 1, 1, 0, 1)]
    assert main(["--db", str(tmp_path / "usage.sqlite")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == [today(), "alice", "2", "17", "3", "7"] and printed[3].split()[0] == "2026-01-01"



def test_keys_carry_daily_tokens_and_a_wrong_setting_is_named(tmp_path):
    (tmp_path / "keys").write_text(f"alice {'a1' * 12} daily_tokens=500 max_requests=3\nbob {'b2' * 12}\n")
    keys = {key.name: key for key in read_keys(tmp_path / "keys").values()}
    assert (keys["alice"].daily_tokens, keys["alice"].max_requests) == (500, 3)
    assert keys["bob"].daily_tokens is None
    (tmp_path / "bad").write_text(f"carol {'c3' * 12} daily_token=5\n")
    with pytest.raises(KeysFileError, match="'daily_token=5'"):
        read_keys(tmp_path / "bad")


def test_a_key_at_its_quota_is_refused_until_the_next_day_and_others_pass(tmp_path):
    service = Service(ServiceSettings("127.0.0.1:1", tmp_path, usage_db=tmp_path / "usage.sqlite"))
    alice, bob = ApiKey("alice", "", 4, daily_tokens=100), ApiKey("bob", "", 4)
    service.count(alice, "m", {"num_prompt_tokens": 60, "num_output_tokens": 39}, 200)
    service.check_quota(alice)  # 99 of 100: admitted
    service.count(alice, "m", {"num_prompt_tokens": 1, "num_output_tokens": 0}, 200)
    with pytest.raises(ApiError) as refused:
        service.check_quota(alice)
    assert (refused.value.status, refused.value.code) == (429, "quota_exceeded")
    assert "used 100 tokens today" in refused.value.message
    assert 0 < int(refused.value.headers()["Retry-After"]) <= 86400
    service.count(bob, "m", {"num_prompt_tokens": 1000, "num_output_tokens": 1000}, 200)
    service.check_quota(bob)  # no quota
    assert seconds_to_next_day(86400 * 3 + 10) == 86390
