"""Shared test utilities: the real SmolLM2 weights (loaded once per process) and the embedded sample data."""
import functools
import json
import threading

from sift.pipeline.corpus import SAMPLE_CORPUS


@functools.lru_cache(maxsize=None)
def _load(attn_implementation: str):
    from sift.model import DEFAULT_MODEL, load_model

    model, tokenizer, _ = load_model(DEFAULT_MODEL, attn_implementation=attn_implementation)
    return model, tokenizer


def smollm2(attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32 on CPU. Shared: do not mutate weights."""
    return _load(attn_implementation)


def wiki_texts(count: int, step: int = 37) -> list[str]:
    """Real Wikipedia leads from the embedded sample corpus."""
    lines = (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[::step][:count]]


def run_in_threads(worker, n: int) -> None:
    """Run worker(k) for k < n on n threads at once; re-raise the first exception any of them raised."""
    errors = []

    def guarded(k: int) -> None:
        try:
            worker(k)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
