from miles_ray.engines.http_common import HttpServerConfig
from miles_ray.keys import cli_key, new_key


def test_cli_key_reads_a_file_keeps_a_given_key_or_writes_a_random_one(tmp_path):
    existing = tmp_path / "existing"
    existing.write_text("from-file\n")
    assert cli_key("ignored", str(existing), "x_") == ("from-file", str(existing))
    assert cli_key("from-env", None, "x_") == ("from-env", "the environment or --api-key")
    given_to_file = tmp_path / "new"
    assert cli_key("from-env", str(given_to_file), "x_") == ("from-env", str(given_to_file))
    assert given_to_file.read_text() == "from-env" and given_to_file.stat().st_mode & 0o777 == 0o600
    key, where = cli_key(None, None, "x_")
    assert len(key) >= 32 and open(where).read() == key and "x_" in where
    assert cli_key(None, None, "x_")[0] != key  # random each time


def test_new_keys_are_256_bit_hex_and_never_read_as_a_flag():
    """SGLang reads its key as ``--api-key <key>``: a key beginning with ``-`` stopped a server (test_sglang)."""
    keys = {new_key() for _ in range(2000)}
    assert len(keys) == 2000  # random each time
    assert all(len(k) == 64 and set(k) <= set("0123456789abcdef") for k in keys)
    made = [cli_key(None, None, "x_")[0], HttpServerConfig().api_key.get_secret_value()]  # a CLI's, a server's
    assert all(len(k) == 64 and set(k) <= set("0123456789abcdef") for k in made)
