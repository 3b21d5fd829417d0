"""A fine-tuned open-QA reader as an MLflow pyfunc model (MLflow's "models from code" file).

    import mlflow, pandas as pd
    reader = mlflow.pyfunc.load_model("models:/<model id>")      # or runs:/..., the UI's Models tab
    reader.predict(pd.DataFrame({"question": ["who founded aldmoor?"], "context": ["Aldmoor was founded by Kessa."]}))
    #   answer   context_index  start  end  score
    #   Kessa    0              22     27   -1.3

Input: one row per question, with its passage in `context` (a string), or several in `contexts`
(a list of strings: the retrieved blocks). Output: the best span over all of them, as the
pipeline's reader picks it (`OpenQA.predict_batch` with no retrieval scores, as for the
BM25 + reader system): its text, which context it is in, its character offsets there, and its score
log p(z | x) + log p(s | x, z). A context longer than the reader's passage length is read as
overlapping windows of that length. No context (or an empty one) gives answer "" and -1 offsets.

The model's artifact `reader` is the saved reader folder (an HF *ForQuestionAnswering with its
tokenizer); `model_config` holds the lengths of training (query_len, passage_len,
max_answer_tokens) and the system's span scorer / softmax (its openqa_config.json). MLflow copies this file into the model; it needs the `components` package
(retro-realm installed, or the model's code path).
"""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd

BATCH_QUESTIONS = 8  # questions per forward pass: (B, K, L) with K windows each


class ReaderModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from components.data.qa_batch import QACollator
        from components.data.tokenize import load_tokenizer
        from components.models.reader import OpenQA, SpanReader

        cfg = context.model_config
        folder = context.artifacts["reader"]
        self.tokenizer = load_tokenizer(folder)  # saved beside the reader by OpenQA.save_pretrained
        # the system's own span scorer and normalisation (openqa_config.json), when it names them
        scorer = {"span_scorer": cfg["span_scorer"]} if cfg.get("span_scorer") else {}
        softmax = {"span_softmax": cfg["span_softmax"]} if cfg.get("span_softmax") else {}
        reader = SpanReader.from_pretrained(folder, **scorer)
        self.model = OpenQA(None, reader, int(cfg["max_answer_tokens"]), **softmax).eval()
        self.collator = QACollator(self.tokenizer, query_len=int(cfg["query_len"]), passage_len=int(cfg["passage_len"]),
                                   top_k=1, max_answer_tokens=int(cfg["max_answer_tokens"]))
        self.window = int(cfg["passage_len"]) - 2  # z tokens of one `[CLS] x [SEP] z [SEP]`

    # -- input ---------------------------------------------------------------------------------
    @staticmethod
    def _contexts(row: pd.Series) -> list[str]:
        many = row.get("contexts")
        if many is not None and not (isinstance(many, float) and np.isnan(many)):
            return [str(c) for c in many]
        one = row.get("context")
        return [] if one is None or (isinstance(one, float) and np.isnan(one)) else [str(one)]

    def _windows(self, text: str) -> list[dict]:
        """The context as blocks of at most `window` tokens, half overlapping; offsets stay in `text`."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
        if not ids:
            return []
        w, stride = self.window, max(1, self.window // 2)
        starts = list(range(0, max(len(ids) - w, 0) + 1, stride))
        if starts[-1] + w < len(ids):
            starts.append(len(ids) - w)
        return [{"text": text, "input_ids": ids[s : s + w], "offsets": offs[s : s + w]} for s in starts]

    # -- predict -------------------------------------------------------------------------------
    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        """model_input: a DataFrame (question, context | contexts) -> a DataFrame, one row per question.
        The logged signature (flows/_stage.py) is the schema MLflow enforces: a DataFrame hint gives MLflow
        no schema of its own to infer, and without a hint it warns at every load and log of the model."""
        rows = []
        for lo in range(0, len(model_input), BATCH_QUESTIONS):
            chunk = model_input.iloc[lo : lo + BATCH_QUESTIONS]
            questions, blocks, owner = [], [], []
            for _, row in chunk.iterrows():
                windows, which = [], []
                for c, text in enumerate(self._contexts(row)):
                    for z in self._windows(text):
                        windows.append(z)
                        which.append(c)
                questions.append(str(row["question"]))
                blocks.append(windows or [None])  # no context: the null document only, answer ""
                owner.append(which)
            batch = self.collator.encode(questions, blocks)
            texts = [[None if z is None else z["text"] for z in zs] for zs in blocks]
            for b, best in enumerate(self.model.predict_batch(batch, texts)):
                if best["block"] < 0:
                    rows.append({"answer": "", "context_index": -1, "start": -1, "end": -1, "score": float("-inf")})
                    continue
                k, off = best["block"], batch["z_char_offsets"][b, best["block"]]
                start, end = int(off[best["start"], 0]), int(off[best["end"], 1])
                rows.append({"answer": best["answer"], "context_index": owner[b][k], "start": start, "end": end,
                             "score": best["score"]})
        return pd.DataFrame(rows, columns=["answer", "context_index", "start", "end", "score"])


mlflow.models.set_model(ReaderModel())
