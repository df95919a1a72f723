from crag.backends.lexical import LexicalScorer
from crag.text import TermWeights, content_terms, keywords, split_sentences, stem, tokenize, word_windows


def test_english_tokens_are_lowercased_stemmed_without_stop_words():
    assert tokenize("How often are the Filters replaced?") == ["often", "filter", "replac"]


def test_japanese_ngrams_without_dictionary():
    assert tokenize("梅雨の時期", "cjk_ngram") == ["梅", "雨", "の", "時", "期", "梅雨", "雨の", "の時", "時期"]


def test_digits_end_where_japanese_begins():
    # Regression: the word pattern used to swallow "月から…" after a digit as one long token.
    tokens = tokenize("5月から7月", "cjk_ngram")
    assert "5" in tokens and "7" in tokens and "月" in tokens
    assert all(len(t) <= 2 for t in tokens)


def test_sudachi_tokenizer_returns_content_words():
    tokens = tokenize("梅雨は、世界的にどのあたりで見られる気象ですか？", "sudachi")
    assert "梅雨" in tokens and "気象" in tokens
    assert "は" not in tokens  # particles carry no topic


def test_mixed_script_and_full_width_are_normalised():
    assert tokenize("ＡＱ－７の保証", "cjk_ngram")[:2] == ["aq", "7"]


def test_content_terms_drop_question_words():
    assert "what" not in content_terms("What is the warranty?")
    assert content_terms("What is the warranty?") == [stem("warranty")]
    terms = content_terms("富士山の標高は何メートルですか？")
    assert "何" not in terms and "富士" in terms


def test_keywords_keep_readable_words():
    assert keywords("What is the warranty period of the Acme X100?") == ["warranty", "period", "Acme", "X100"]
    assert keywords("日本で梅雨がないのは北海道とどこか。") == ["日本", "梅雨", "北海道"]
    assert keywords("Which Wi-Fi band does the AQ-7 (v2.1) use?") == ["Wi-Fi", "band", "AQ-7", "v2.1", "use"]


def test_sentences_english_and_japanese():
    assert split_sentences("梅雨は雨季です。5月に来る。Hello there. Bye!") == [
        "梅雨は雨季です。",
        "5月に来る。",
        "Hello there.",
        "Bye!",
    ]
    assert split_sentences("line one\nline two") == ["line one", "line two"]


def test_a_period_after_an_initial_or_an_abbreviation_ends_no_sentence():
    """SQuAD 2.0's "Who challenged the plague theory first?" was answered "...bacteriologist J." when
    every period followed by a space ended a sentence."""
    assert split_sentences(
        "The theory was first challenged by British bacteriologist J. F. D. Shrewsbury in 1970. "
        "Christian Whiton, an official in the George W. Bush administration, called for a new agency. "
        "Dr. Smith met the U.S. envoy in Washington, D.C. on Monday."
    ) == [
        "The theory was first challenged by British bacteriologist J. F. D. Shrewsbury in 1970.",
        "Christian Whiton, an official in the George W. Bush administration, called for a new agency.",
        "Dr. Smith met the U.S. envoy in Washington, D.C. on Monday.",
    ]
    assert split_sentences("AQ-7の重さは6.2キログラムです。フィルターは6か月ごとに交換します。 ") == [
        "AQ-7の重さは6.2キログラムです。",
        "フィルターは6か月ごとに交換します。",
    ]
    assert split_sentences("  \n ") == []


def test_a_mark_with_no_space_after_it_ends_no_sentence():
    assert split_sentences("Install ASP.NET first. See page?ID=3 for more.") == [
        "Install ASP.NET first.",
        "See page?ID=3 for more.",
    ]
    assert split_sentences("重さは３．５キログラムです。これは例である．次に進む．") == [
        "重さは３．５キログラムです。",
        "これは例である．次に進む．",
    ]


def test_word_windows():
    text = " ".join(f"w{i}" for i in range(120))
    windows = word_windows(text, 50)
    assert [len(w.split()) for w in windows] == [50, 50, 20]
    assert word_windows("あ" * 250, 50) == ["あ" * 100, "あ" * 100, "あ" * 50]


def test_coverage_weighs_rare_terms_more():
    weights = TermWeights.from_tokens([["common", "rare"], ["common"], ["common"], ["common"]])
    assert weights.idf("rare") > weights.idf("common")
    scorer = LexicalScorer(weights, "cjk_ngram")
    assert scorer.score(["common", "rare"], "rare")[0] > 0.5 > scorer.score(["common", "rare"], "common")[0]
    assert scorer.score([], "x")[0] == 0.0
    assert scorer.score(["x", "y"], "x y") == (1.0, ["x", "y"])  # text is tokenized: no stop words here


def test_merged_weights_add_counts():
    a = TermWeights({"x": 1}, 2)
    b = TermWeights({"x": 2, "y": 1}, 3)
    m = a.merged(b)
    assert m.document_frequency == {"x": 3, "y": 1} and m.n_documents == 5


def test_latin_diacritics_fold_but_kana_keeps_its_marks():
    from crag.text import normalize

    assert tokenize("Möngke Khan") == tokenize("Mongke khan")
    assert normalize("がぎぐ café") == "がぎぐ cafe"
