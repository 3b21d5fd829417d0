"""Speed paths of the pre-training step, each held by a test to a plain reference computation.

    fused_ce.py         the MLM head's vocabulary projection fused with its cross-entropy
    bert_last_layer.py  the encoder's last layer at the positions a loss reads only
    dropout.py          dropout masks from 16 random bits per element (a CPU's bernoulli_ is slow)
"""
