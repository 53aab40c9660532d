"""Deterministic generator of varied tokenizer test text (>= 1 MB).

`corpus(seed)` returns a list of documents as bytes. Each kind of document
aims at a stage of the Qwen2/Qwen3 tokenizer where an implementation can
go wrong: the split regex (contractions, letters vs numbers vs punctuation,
whitespace runs and the `\\s+(?!\\S)` rule), NFC (decomposed accents,
reordering of combining marks, Hangul jamo, singletons), added tokens found
in the text (whole, partial, adjacent, inside words), byte-level BPE on
many scripts and 4-byte characters, and invalid UTF-8, which HF only ever
sees after bytes.decode("utf-8", "replace").

Nothing here comes from a tokenizer: expected ids always come from HF.
Run as a script to write the corpus to a file: python tokenizer_corpus.py OUT
"""

import random
import sys
import unicodedata

WORDS = (
    "the of and to in is was for that with as on by at from his her it they we you "
    "this which be or are an not have had has were but all their one can there been "
    "more if when will would who so no out up into than them some time could only "
    "other new about two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since "
    "against go came right used take three tokenizer merge rank byte encoder decoder "
    "gradient optimizer checkpoint attention embedding normalization Qwen torchtitan "
    "naïve café résumé coöperate façade jalapeño Zürich São Paulo Ærøskøbing"
).split()

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M",
                "'LL", "'D", "'ſ", "'Ll", "'rE", "'x", "''", "'", "’s", "'K"]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|vision_pad|>"]
# Strings the test registers as extra added tokens (with lstrip, rstrip,
# single_word and normalized flags) in the tokenizer it trains.
EXTRA_ADDED = ["[LSTRIP]", "[RSTRIP]", "[WORD]", "naïve", "<|im", "[BOTH]"]
NEAR_SPECIALS = ["<|im_end", "<|im_end|", "<| im_end|>", "<<|im_start|>>", "<|IM_END|>",
                 "<think", "</think >", "<|endoftext|><|endoftext|>", "<|im_start|><|im_end|>",
                 "x<|im_end|>y", " <|im_end|> ", "\n<|im_end|>\n", "<|im<|im_end|>",
                 "[WORD]x", "x[WORD]", " [WORD] ", "é[WORD]", "_[WORD]", "²[WORD]",
                 "  [LSTRIP]  ", "\t[RSTRIP]\n\n", "a [BOTH]  b", "nai\u0308ve", "NAÏVE",
                 "naïveté", "<|im_star", "<|im|>"]

UNI_SPACES = ["\u00a0", "\u2000", "\u2003", "\u2009", "\u200a", "\u3000", "\u0085", "\u2028",
              "\u2029", "\u202f", "\u205f", "\u1680", "\u180e", "\u200b", "\ufeff", "\x0b", "\x0c",
              "\x1c", "\x1f"]

EMOJI = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200D\U0001F469\u200D\U0001F467",
         "\U0001F1EF\U0001F1F5", "\U0001F1FA\U0001F1F8", "1\uFE0F\u20E3", "\u2764\uFE0F",
         "\U0001F9D1\U0001F3FE\u200D\U0001F4BB", "\U0001F3F3\uFE0F\u200D\U0001F308", "\u263A",
         "\U0001F916", "\U0001F525\U0001F525\U0001F525", "\U0001FAE0", "\U0001F4A9", "\u2728"]

# Blocks for random text (code point ranges; surrogates excluded by choice).
BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x530, 0x58F),
          (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x980, 0x9FF), (0xB80, 0xBFF),
          (0xE00, 0xE7F), (0x10A0, 0x10FF), (0x1100, 0x11FF), (0x1200, 0x137F), (0x13A0, 0x13FF),
          (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20CF), (0x2100, 0x214F),
          (0x2150, 0x218F), (0x2190, 0x22FF), (0x2500, 0x257F), (0x2800, 0x28FF), (0x3000, 0x30FF),
          (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xA000, 0xA48F), (0xAC00, 0xD7A3), (0xE000, 0xE0FF),
          (0xF900, 0xFAFF), (0xFB00, 0xFB4F), (0xFE00, 0xFE0F), (0xFE30, 0xFE6F), (0xFF00, 0xFFEF),
          (0xFFF0, 0xFFFF), (0x10000, 0x1007F), (0x1D400, 0x1D7FF), (0x1D2C0, 0x1D2DF),
          (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0x2F800, 0x2FA1F), (0x31350, 0x323AF),
          (0xE0000, 0xE007F), (0xF0000, 0xF00FF), (0x10FF00, 0x10FFFF), (0x0, 0x1F)]

COMBINING = [0x300, 0x301, 0x302, 0x303, 0x308, 0x30A, 0x30C, 0x323, 0x327, 0x328, 0x331, 0x345,
             0x5B0, 0x5B4, 0x5BC, 0x5C1, 0x64B, 0x650, 0x651, 0x93C, 0x94D, 0x9BC, 0x9BE, 0x9D7,
             0xE31, 0xE48, 0x20D7, 0x3099, 0x309A, 0x1DC0, 0xFE20, 0x1D165, 0x1D16D]
SINGLETONS = ["\u212b", "\u2126", "\u212a", "\u0340", "\u0341", "\u0343", "\u0374", "\u037e",
              "\u0387", "\u1f71", "\u2000", "\u2001", "\u2329", "\u232a", "\uf900", "\uf9d2",
              "\ufa10", "\u0958", "\u095c", "\u09dc", "\u0a33", "\u0f43", "\ufb1d", "\ufb2a",
              "\U0002f800", "\U0002fa1d", "\u1e9b\u0323", "\u0344", "\u0f73"]

FIRST = "Alice Bob Wei Mei Ivan Olga Ahmed Fatima Kenji Yuki Jürgen Zoë".split()


def _words(r, n):
    out = []
    for _ in range(n):
        w = r.choice(WORDS)
        x = r.random()
        if x < 0.08:
            w = w.capitalize()
        elif x < 0.1:
            w = w.upper()
        elif x < 0.16:
            w += r.choice(CONTRACTIONS)
        out.append(w)
    return out


def prose(r):
    paras = []
    for _ in range(r.randint(3, 30)):
        sents = []
        for _ in range(r.randint(1, 8)):
            s = " ".join(_words(r, r.randint(3, 25)))
            s = s[0].upper() + s[1:]
            if r.random() < 0.2:
                s += ", " + r.choice(FIRST) + " said"
            if r.random() < 0.1:
                s = '"' + s + '"'
            if r.random() < 0.1:
                s += " (see https://example.org/a_b-c?d=%d&e=f#g)" % r.randint(0, 10**6)
            if r.random() < 0.05:
                s += " mail: %s.%d@example.com" % (r.choice(FIRST).lower(), r.randint(1, 99))
            sents.append(s + r.choice([".", ".", "!", "?", "...", ";", " --", ":"]))
        paras.append(" ".join(sents))
    return r.choice(["\n\n", "\n", "\r\n\r\n", "\n\n\n"]).join(paras) + r.choice(["", "\n", " ", "  \n"])


def code(r):
    ind = r.choice(["    ", "  ", "\t", "        "])
    nl = "\r\n" if r.random() < 0.15 else "\n"
    lines = []
    for _ in range(r.randint(5, 40)):
        name = "_".join(r.choice(WORDS).lower() for _ in range(r.randint(1, 3)))
        kind = r.randrange(8)
        if kind == 0:
            lines += ["def %s(self, x%d, *args, **kw):" % (name, r.randint(0, 9)),
                      ind + '"""%s."""' % " ".join(_words(r, 6)),
                      ind + "if x is None or len(args) >= %d:" % r.randint(0, 99),
                      ind * 2 + "return {'%s': [%s]}" % (name, ", ".join(str(r.randint(0, 999)) for _ in range(4))),
                      ind + "return x ** 2 // 3 % 7  # " + " ".join(_words(r, 4)), ""]
        elif kind == 1:
            lines += ["static int %s(const char *s, size_t n) {" % name,
                      ind + "for (size_t i = 0; i < n; i++) if (s[i] == '\\n') return -1;",
                      ind + "return n > 0x%x ? (int)(n >> 3) : 0;" % r.randint(0, 65535), "}", ""]
        elif kind == 2:
            lines.append('{"%s": %d, "ok": true, "list": [1.5e-3, -2, null], "s": "a\\"b"}'
                         % (name, r.randint(-9999, 9999)))
        elif kind == 3:
            lines.append("<div class=\"%s\">&lt;%s&gt;</div>" % (name, name.upper()))
        elif kind == 4:
            lines.append(ind * r.randint(0, 4) + "x%s=%s;%s" % (name, r.randint(0, 10**9), " " * r.randint(0, 6)))
        elif kind == 5:
            lines.append("")
            lines.append(" " * r.randint(1, 40))
        elif kind == 6:
            lines.append("    $ ./%s --flag=%d | grep -E '^[a-z]+$' >> out.log 2>&1" % (name, r.randint(0, 9)))
        else:
            lines.append("// " + "=" * r.randint(1, 80))
    return nl.join(lines) + nl


def cjk(r):
    punct = "，。！？：；“”（）《》、…—"
    parts = []
    for _ in range(r.randint(20, 200)):
        k = r.randrange(6)
        if k < 3:
            parts.append("".join(chr(r.randint(0x4E00, 0x9FA5)) for _ in range(r.randint(1, 40))))
            parts.append(r.choice(punct))
        elif k == 3:
            parts.append("".join(chr(r.randint(0x3041, 0x30FA)) for _ in range(r.randint(1, 12))))
        elif k == 4:
            parts.append(" ".join("".join(chr(r.randint(0xAC00, 0xD7A3)) for _ in range(r.randint(1, 5)))
                                  for _ in range(r.randint(1, 6))) + r.choice([". ", "? ", " "]))
        else:
            parts.append(r.choice(["ＡＢＣ１２３", "2024年5月", " GPU ", "Qwen3模型", "ｶﾀｶﾅ", "\n", "\n\n", "　"]))
    return "".join(parts)


def emoji(r):
    out = []
    for _ in range(r.randint(50, 400)):
        x = r.random()
        if x < 0.5:
            out.append(r.choice(EMOJI))
        elif x < 0.8:
            out.append(" " + r.choice(WORDS))
        else:
            out.append(r.choice([" ", "  ", "\n", "!", "..."]))
    return "".join(out)


def whitespace(r):
    out = []
    for _ in range(r.randint(30, 200)):
        x = r.random()
        if x < 0.25:
            out.append(" " * r.choice([1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 257, 600]))
        elif x < 0.4:
            out.append("\n" * r.randint(1, 40))
        elif x < 0.5:
            out.append("".join(r.choice([" ", "\t", "\n", "\r\n", "\r", "\x0b", "\x0c"]) for _ in range(r.randint(1, 60))))
        elif x < 0.62:
            out.append("".join(r.choice(UNI_SPACES + [" ", "\n"]) for _ in range(r.randint(1, 12))))
        else:
            out.append(r.choice(WORDS) if r.random() < 0.7 else r.choice(["!", "?!", "#", "1", "(", "é"]))
    if r.random() < 0.5:
        out.append(" " * r.randint(1, 50))
    return "".join(out)


def numbers(r):
    out = []
    for _ in range(r.randint(50, 300)):
        k = r.randrange(9)
        if k == 0:
            out.append(str(r.randint(0, 10 ** r.randint(1, 40))))
        elif k == 1:
            out.append("%.*f" % (r.randint(0, 8), r.uniform(-1e6, 1e6)))
        elif k == 2:
            out.append("{:,}".format(r.randint(0, 10**12)))
        elif k == 3:
            out.append("".join(chr(0x660 + r.randint(0, 9)) for _ in range(r.randint(1, 6))))
        elif k == 4:
            out.append(r.choice(["²", "³", "½", "¾", "Ⅻ", "ⅷ", "①", "⑳", "０１２", "𝟘𝟙", "𝋀𝋁", "〇", "٫"]))
        elif k == 5:
            out.append("v%d.%d.%d-rc%d" % tuple(r.randint(0, 20) for _ in range(4)))
        elif k == 6:
            out.append("0x%X" % r.getrandbits(64))
        elif k == 7:
            out.append("%d%s" % (r.randint(1, 99), r.choice(["th", "px", "GB", "kHz", "%", "°C", "ms"])))
        else:
            out.append(r.choice(WORDS))
        out.append(r.choice([" ", " ", ", ", "\n", "", "+", "-", "/"]))
    return "".join(out)


def specials(r):
    out = []
    for _ in range(r.randint(5, 40)):
        k = r.randrange(4)
        if k == 0:
            out.append("<|im_start|>%s\n%s<|im_end|>\n" % (r.choice(["system", "user", "assistant"]),
                                                           " ".join(_words(r, r.randint(1, 30)))))
        elif k == 1:
            out.append("<|im_start|>assistant\n<think>\n%s\n</think>\n\n%s<|im_end|>" %
                       (" ".join(_words(r, 10)), " ".join(_words(r, 5))))
        elif k == 2:
            out.append(r.choice(NEAR_SPECIALS + SPECIALS + EXTRA_ADDED))
        else:
            out.append(r.choice(WORDS) + r.choice(SPECIALS + EXTRA_ADDED) + r.choice(WORDS))
        out.append(r.choice(["", " ", "\n", "  ", "<|endoftext|>"]))
    return "".join(out)


def combining(r):
    out = []
    for _ in range(r.randint(40, 200)):
        k = r.randrange(6)
        if k == 0:  # decomposed Latin / Vietnamese / Greek text
            w = r.choice(["Việt Nam", "naïve café", "Ελληνικά ώρα", "Ångström", "Łódź", "crème brûlée",
                          "Ǆemal", "ﬁnance", "Ḝḝ"])
            out.append(unicodedata.normalize(r.choice(["NFD", "NFC", "NFKD"]), w))
        elif k == 1:  # base + marks in random (often non-canonical) order
            base = r.choice("aeiouAEIOUnsSgkyhאבשاب가ก")
            out.append(base + "".join(chr(r.choice(COMBINING)) for _ in range(r.randint(1, 5))))
        elif k == 2:  # conjoining Hangul jamo L V (T)
            s = chr(0x1100 + r.randint(0, 18)) + chr(0x1161 + r.randint(0, 20))
            if r.random() < 0.6:
                s += chr(0x11A8 + r.randint(0, 26))
            out.append(s)
        elif k == 3:
            out.append(r.choice(SINGLETONS))
        elif k == 4:
            out.append(unicodedata.normalize("NFD", "".join(chr(r.randint(0xAC00, 0xD7A3)) for _ in range(3))))
        else:
            out.append(r.choice([" ", "\n", "'s ", " the ", "'ſ"]))
    return "".join(out)


def random_unicode(r):
    out = []
    for _ in range(r.randint(100, 800)):
        lo, hi = r.choice(BLOCKS)
        c = r.randint(lo, hi)
        if 0xD800 <= c < 0xE000:
            c = 0xFFFD
        out.append(chr(c))
        if r.random() < 0.15:
            out.append(r.choice([" ", "\n", " a", "1"]))
    return "".join(out)


def _corrupt(r, b):
    b = bytearray(b)
    bad = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf",
           b"\xf4\x90\x80\x80", b"\xf5\x80", b"\xff", b"\xfe", b"\xe2\x82", b"\xf0\x9f\x98", b"\xf0\x9f",
           b"\xc3", b"\xe4\xb8", b"\xf0\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc2\x41", b"\x00"]
    for _ in range(r.randint(1, 40)):
        pos = r.randint(0, len(b))
        if r.random() < 0.7:
            b[pos:pos] = r.choice(bad)
        elif pos < len(b):
            b[pos] = r.randint(0x80, 0xFF)
    if r.random() < 0.5 and len(b) > 4:  # cut in the middle of a sequence
        b = b[: r.randint(1, len(b))]
    return bytes(b)


KINDS = [prose, prose, code, code, cjk, emoji, whitespace, numbers, specials, specials, combining,
         random_unicode]


def corpus(seed=0, target_bytes=1_150_000):
    """Documents (bytes) totalling at least target_bytes; about one in seven
    is made invalid UTF-8."""
    r = random.Random(seed)
    docs, total, i = [], 0, 0
    while total < target_bytes:
        kind = KINDS[i % len(KINDS)]
        i += 1
        b = kind(r).encode("utf-8", "surrogatepass")
        if r.random() < 1 / 7:
            b = _corrupt(r, b)
        docs.append(b)
        total += len(b)
    # edge cases that must each be a document of their own
    docs += [b"", b" ", b"\n", b"\xff", b"\xe2\x82", b"a" * 5000, b" " * 5000 + b"x",
             "\u3000".encode() * 300, b"\n" * 3000, "<|im_end|>".encode(), b"Hello world",
             ("ab" * 2000).encode(), "é".encode() * 2000, "\U0001F600".encode() * 500]
    return docs


if __name__ == "__main__":
    docs = corpus()
    with open(sys.argv[1], "wb") as f:
        for d in docs:
            f.write(d)
    print(len(docs), sum(map(len, docs)))
