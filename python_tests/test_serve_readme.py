"""README.md, "Serving: the HTTP server": its commands as written, against ``specdec serve --zoo`` (the shipped
family, a server process on a free port instead of 8000).

* The curl command's completion is the family target's plain greedy decoding of the prompt (``generate()``).
* The Python example (the real ``openai`` client) runs as written: its completion is the same greedy decoding of
  its prompt, and its seeded, streamed sample stops before its stop string.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from test_serve import httpx  # (skips without the server's packages)
from test_serve_cli import free_port  # noqa: E402

from specdec_ext.generate import generate  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def section_blocks() -> tuple[str, str]:
    """The section's bash and python code blocks."""
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Serving: the HTTP server"):]
    section = section[:section.index("\n## ", 5)]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return bash, python


@pytest.fixture(scope="module")
def zoo_server():
    pytest.importorskip("openai")
    bash, _ = section_blocks()
    assert "specdec serve --zoo" in bash
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec_ext", "serve", "--zoo", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        yield port
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def family():
    from specdec_ext.zoo import load_family

    return load_family()


def greedy_text(family, prompt: str, n: int) -> str:
    ids = family.tokenizer(prompt)["input_ids"]
    out, _ = generate(family.target, None, torch.tensor(ids), max_new_tokens=n)
    return family.tokenizer.decode(out[len(ids):].tolist(), skip_special_tokens=True)


def test_the_readme_curl_command(zoo_server, family):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    bash, _ = section_blocks()
    command = bash[bash.index("curl "):].replace("8000", str(zoo_server))
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["choices"][0]["text"] == greedy_text(family, "def parse_args(argv):\n", 32)
    assert body["usage"]["completion_tokens"] <= 32


def test_the_readme_python_example(zoo_server, family):
    _, code = section_blocks()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace("8000", str(zoo_server)), "README.md", "exec"), {})
    want = greedy_text(family, "import os\n", 32)
    text = printed.getvalue()
    assert text.startswith(want + " ")  # the completion's text, then its finish reason and token count
    head = re.match(r" (stop|length) (\d+)\n", text[len(want):])
    assert head and int(head.group(2)) <= 32, text
    streamed = text[len(want) + head.end():]
    assert streamed and "\n\n" not in streamed  # (the sample stopped before its stop string, or at its budget)
