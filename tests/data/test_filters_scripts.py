"""Quality filters and scripts written without spaces: Chinese/Thai prose is not dropped by
word rules that assume spaces, and text in spaced scripts meets exactly the old rules."""

from __future__ import annotations

from stacklm.data.quality.filters import FilterConfig, filter_reason, text_stats

ZH = ("人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
      "该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。长江是亚洲第一长河，也是世界第三长河。"
      "它发源于青藏高原的唐古拉山脉，流经十一个省级行政区，最后在上海注入东海。北京是中华人民共和国的首都。") * 2
TH = "ประเทศไทยเป็นประเทศที่ตั้งอยู่ในภูมิภาคเอเชียตะวันออกเฉียงใต้มีประชากรประมาณหกสิบหกล้านคนเมืองหลวงคือกรุงเทพมหานคร " * 3


def _reason(text: str) -> str | None:
    return filter_reason({"domain": "prose", "text": text}, FilterConfig())


def test_chinese_and_thai_prose_are_kept():
    assert text_stats(ZH).unspaced > 0.9 * text_stats(ZH).alpha
    assert _reason(ZH) is None
    assert _reason(TH) is None


def test_spaced_text_keeps_the_word_rules_even_with_a_few_cjk_letters():
    long_words = " ".join(["incomprehensibilities"] * 60)
    assert _reason(long_words) == "mean_word_length"
    assert _reason(long_words + " 中文") == "mean_word_length"  # 2 Han letters among 1,260: the old rule
    assert _reason("word " * 30 + "a" * 200) == "too_few_words"
