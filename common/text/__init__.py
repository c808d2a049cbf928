"""Generic text pieces any language-model task builds on: corpora (``corpus``), tokenizers trained on them and
cached by what they were trained on (``tokenizer``), and fixed-length token blocks served by the plan/batch
protocol of the input pipeline (``blocks``)."""
