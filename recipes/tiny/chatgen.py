"""ChatML conversations built from the offline sources, one builder per domain.

A conversation is a list of {"role", "content"} messages. `render` writes it in ChatML, the
format of the shipped chat template. The user turns double as the drafter prompt sets.
"""

import random
import re
from collections import Counter
from dataclasses import dataclass

import mathgen
import sources

SYSTEM = "You are a helpful assistant."
SYSTEM_SHARE = 0.1
MAX_ANSWER = 1800  # characters; keeps most conversations inside the 512-token context

_STOP = set("""about above after again against because been before being below between both
could doing down during each further having here itself just more most other ought ourselves
over same should some such than that their theirs them themselves then there these they this
those through under until very what when where which while whom will with would your yours
shall unto upon said thou thee thy hath into were have from like only also much must every
little great never always himself herself myself yourself itself thing things
anything nothing something everything""".split())


def render(messages: list[dict]) -> str:
    """ChatML text of a conversation (identical to the shipped tokenizer's chat template)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _conv(rng: random.Random, *turns: str) -> list[dict]:
    """Alternate user/assistant turns, optionally behind the default system message."""
    msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < SYSTEM_SHARE else []
    roles = ("user", "assistant")
    return msgs + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def _clip(text: str, limit: int = MAX_ANSWER) -> str:
    """Cut at the last paragraph (or sentence) boundary before `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind(". ", 0, limit) + 1
    return text[:cut if cut > 0 else limit].rstrip()


def _first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", " ".join(text.split()))
    return m.group(1) if m else text.split("\n")[0]


def _keywords(text: str, rng: random.Random, k: int) -> list[str]:
    """Up to k frequent content words of a passage (lowercase, 5+ letters)."""
    words = [w for w in re.findall(r"\b[a-z]{5,}\b", text) if w not in _STOP]
    common = [w for w, _ in Counter(words).most_common(6)]
    return rng.sample(common, min(k, len(common)))


@dataclass
class Pools:
    """Source material the builders draw from (loaded once)."""
    functions: list
    modules: list
    topics: dict
    manual: list
    gnu: list
    jargon: list
    debian_faq: list
    austen: list      # paragraphs
    kjv: list         # (chapter name, verses)
    fortunes: list
    narrative: list   # short plain Austen sentences (math story padding)

    @classmethod
    def load(cls, stdlib: list) -> "Pools":
        austen = [p for novel in sources.austen_novels() for ch in novel
                  for p in ch.split("\n\n") if len(p) > 200]
        return cls(functions=sources.stdlib_functions(stdlib),
                   modules=sources.module_docstrings(stdlib), topics=sources.pydoc_topics(),
                   manual=sources.python_manual(), gnu=sources.gnu_standards(),
                   jargon=sources.jargon_entries(), debian_faq=sources.debian_faq(),
                   austen=austen, kjv=sources.kjv_chapters(), fortunes=sources.fortunes(),
                   narrative=_plain_sentences(austen))


def _plain_sentences(paragraphs: list[str]) -> list[str]:
    """Sentences of 6-24 words without dialogue, semicolons or abbreviations, in source order."""
    out = []
    for para in paragraphs:
        for sent in re.findall(r"[A-Z][^.!?]*[.]", " ".join(para.split())):
            if (6 <= len(sent.split()) <= 24 and not re.search(r"[\"“”;:_()]", sent)
                    and not re.search(r"\b(Mr|Mrs|Dr|St|Col)\.$", sent)):
                out.append(sent)
    return out


# ---------------------------------------------------------------- math

# Half of the math prompts carry the usual "reason step by step ... \boxed{}" instruction.
_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_MATH_SUFFIX = [_BOXED] * 5 + ["", "", " Show your work.", " Explain your reasoning step by step.",
                                "\nSolve it step by step."]


# Share of instructed problems told as a story: pronouns for the name, an unrelated sentence.
STORY_SHARE = 0.5


def _storify(q: str, rng: random.Random, pools: Pools) -> str:
    """GSM8K-like surface: after its first mention the name becomes a pronoun, and a sentence
    of unrelated narrative joins the question, so the instruction, not the wording, marks the
    request as a math problem."""
    name = next((w for w in re.findall(r"[A-Z][a-z]+", q) if w in mathgen.NAMES), None)
    if name:
        # four entries, not two: the shipped stage-2 corpus was drawn with this list
        subj, poss = rng.choice([("she", "her"), ("he", "his"), ("she", "her"), ("he", "his")])
        first = q.index(name) + len(name)

        def pronoun(m: re.Match) -> str:
            word = poss if m.group(1) else subj
            starts = q[:first + m.start()].rstrip().endswith((".", "?", "!"))
            return word.capitalize() if starts else word
        q = q[:first] + re.sub(rf"\b{name}('s)?\b", pronoun, q[first:])
    sentences = re.split(r"(?<=[.!?])\s+", q)
    sentences.insert(rng.randrange(len(sentences)), rng.choice(pools.narrative))
    return " ".join(sentences)


def math_chat(rng: random.Random, pools: Pools) -> list[dict]:
    q, steps, ans = mathgen.problem(rng)
    suffix = rng.choice(_MATH_SUFFIX)
    if suffix.strip() and rng.random() < STORY_SHARE:
        q = _storify(q, rng, pools)
    intro = rng.choice(["", "", "Let's solve this step by step.\n", "Step by step:\n"])
    if "boxed" in suffix or rng.random() < 0.3:
        final = rng.choice([f"The answer is \\boxed{{{ans}}}.", f"So the final answer is \\boxed{{{ans}}}."])
    else:
        final = rng.choice([f"#### {ans}", f"The answer is {ans}."])
    return _conv(rng, q + suffix, intro + "\n".join(steps) + "\n" + final)


# ---------------------------------------------------------------- code

_STUB_ASK = ["Write a solution to the following problem and make sure that it passes the tests:",
             "Complete the following Python function:", "Implement the function below.",
             "Finish this Python code:", "Fill in the body of this function:"]


def code_chat(rng: random.Random, pools: Pools) -> list[dict]:
    f = rng.choice(pools.functions)
    imports = "\n".join(f["imports"])
    full = (imports + "\n\n\n" if imports else "") + f["source"]
    block = f"```python\n{full}\n```"
    lead = rng.choice(["", "", "Here is the implementation:\n", "Here is a solution:\n"])
    kind = rng.random()
    where = f" of class `{f['owner']}`" if f["owner"] else ""
    if kind < 0.45:
        stub = (imports + "\n\n\n" if imports else "") + f["stub"]
        return _conv(rng, f"{rng.choice(_STUB_ASK)}\n```python\n{stub}\n\n```", lead + block)
    if kind < 0.8:
        what = _first_sentence(f["doc"].split("\n\n")[0]).rstrip(".") or f["name"]
        if what[:2] != what[:2].upper():
            what = what[0].lower() + what[1:]
        noun, sig = ("method" if f["owner"] else "function"), f["signature"]
        ask = rng.choice([f"Write a Python {noun} `{sig}`{where} that does the following: {what}.",
                          f"Write a Python {noun} `{sig}`{where}. Its job: {what}.",
                          f"Implement `{sig}`{where} in Python: {what}."])
        return _conv(rng, ask, lead + block)
    ask = rng.choice(["What does this Python function do?", "Explain this code:",
                      "Write a docstring for this function:"])
    return _conv(rng, f"{ask}\n```python\n{f['body_without_doc']}\n```", _clip(f["doc"]))


# ---------------------------------------------------------------- docs

def _body(text: str) -> str:
    """A manual node without its heading line."""
    return text.split("\n", 1)[1].strip() if "\n" in text else text


def docs_chat(rng: random.Random, pools: Pools) -> list[dict]:
    kind = rng.random()
    if kind < 0.15:
        title, text = rng.choice([n for n in pools.manual if n[0].endswith("?")] or pools.manual)
        return _conv(rng, title, _clip(_body(text)))
    if kind < 0.3:
        key = rng.choice(sorted(pools.topics))
        name = f"the `{key}` statement" if key.isalpha() else key.replace("-", " ")
        ask = rng.choice([f"Explain {name} in Python.", f"How does {name} work in Python?",
                          f"What is {name} in Python?"])
        return _conv(rng, ask, _clip(pools.topics[key]))
    if kind < 0.5:
        title, text = rng.choice(pools.manual)
        mod = re.match(r"^([\w.]+) — (.+)$", title)
        if mod:
            ask = rng.choice([f"What is the Python `{mod.group(1)}` module for?",
                              f"Explain the {mod.group(1)} module."])
        else:
            ask = rng.choice([f"Tell me about {title}.", f"Explain {title} in Python.",
                              f"What does the Python documentation say about {title}?"])
        return _conv(rng, ask, _clip(_body(text)))
    if kind < 0.62:
        mod, doc = rng.choice(pools.modules)
        return _conv(rng, rng.choice([f"What does the Python module `{mod}` do?",
                                      f"Describe the `{mod}` module."]), _clip(doc))
    if kind < 0.85:
        term, body = rng.choice(pools.jargon)
        ask = rng.choice([f"What does “{term}” mean?", f"Define the hacker term '{term}'.",
                          f"What is {term}?"])
        return _conv(rng, ask, _clip(body))
    if kind < 0.95:
        q, a = rng.choice(pools.debian_faq)
        return _conv(rng, q, _clip(a))
    title, text = rng.choice(pools.gnu)
    return _conv(rng, f"What do the GNU coding standards say about {title}?", _clip(_body(text)))


# ---------------------------------------------------------------- prose

_FOLLOW_UP = [("Continue.", "next"), ("Please go on.", "next"),
              ("Make it shorter.", "short"), ("Summarize that in one sentence.", "short")]


def prose_chat(rng: random.Random, pools: Pools) -> list[dict]:
    kind = rng.random()
    if kind < 0.4:
        i = rng.randrange(len(pools.austen) - 1)
        para, nxt = pools.austen[i], pools.austen[i + 1]
        first = _first_sentence(para)
        if kind < 0.15 and len(first) < len(para) - 40:
            answer = para[len(first):].strip()
            return _conv(rng, f"Continue the story: {first}", _clip(answer))
        words = _keywords(para, rng, rng.choice([1, 2]))
        topic = " and ".join(words) or "a visit"
        form = rng.choice(["a short passage", "a paragraph", "a short story", "a scene",
                           "a few sentences", "a letter"])
        ask = rng.choice([f"Write {form} about {topic}.", f"Compose {form} about {topic}.",
                          f"Write {form} in the style of Jane Austen about {topic}.",
                          f"Describe {topic} in {form}."])
        follow, mode = rng.choice(_FOLLOW_UP)
        if rng.random() < 0.3:
            second = _clip(nxt) if mode == "next" else _first_sentence(para)
            return _conv(rng, ask, _clip(para), follow, second)
        return _conv(rng, ask, _clip(para))
    if kind < 0.6:
        name, verses = rng.choice(pools.kjv)
        start = rng.randrange(len(verses))
        chosen = verses[start:start + rng.randint(2, 5)]
        word = (_keywords(" ".join(chosen).lower(), rng, 1) or ["faith"])[0]
        ask = rng.choice([f"What does the Bible say about {word}?",
                          f"Quote a Bible passage about {word}.",
                          f"Give me a verse from {name.rsplit(' ', 1)[0]}."])
        text = "\n".join(f"{name}:{start + j + 1} {v}" for j, v in enumerate(chosen))
        return _conv(rng, ask, text)
    cookie = rng.choice(pools.fortunes)
    word = (_keywords(cookie.lower(), rng, 1) or ["life"])[0]
    ask = rng.choice(["Tell me a joke.", "Give me a quote.", "Say something wise.",
                      f"Tell me something funny about {word}.", f"Give me a quote about {word}.",
                      "Write a short dialogue.", "Tell me a fortune."])
    return _conv(rng, ask, cookie)


BUILDERS = {"math": math_chat, "code": code_chat, "docs": docs_chat, "prose": prose_chat}


def user_turns(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]
