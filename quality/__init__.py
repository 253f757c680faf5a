"""Research tools over the serving engine: what skipping tiles costs in answers and how to choose the profile
thresholds. Nothing here is imported by serving code (`sift.runtime`).

    sift-eval        eval.py: answers of each mode against dense and the gold answers of a QA set
    sift-calibrate   calibrate.py: thresholds chosen from answers on held-in questions, checked on held-out ones
    sift-serve-demo  demo.py: HotpotQA questions answered with sparse and dense prefill, side by side
    oracle.py        the in-context oracle (the best bits of the index's format for one prompt), a reference
    recall.py        the SIFT paper's in-context recall of an index's bits
    qa.py            QA-set readers and the long-document sets
    prompts.py       the chat prompt and the data the tools share with the demo
"""
