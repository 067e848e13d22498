"""The small task families the built-in model is trained and evaluated on.

Each family yields chat exchanges ``(question, answer)`` with varied natural phrasings and a
short, exact answer: the bare result, no sentence around it (``"42"``, ``"tenalp"``,
``"apple, fig, pear"``), so evaluation is exact match on the stripped reply.
``generate(family, n, seed)`` is deterministic: the same arguments give the same list on every
machine and Python version (``random.Random`` seeded with a string is hash-seed independent).
The training corpus (``scripts/train_builtin.py``) and the evaluation (``dllm eval``) draw from
the same generator with different seeds. ``held_out=True`` asks in other words: templates that
training never uses (written with the words of the training templates), and words sometimes
Capitalised or in CAPITALS (sorting then ignores case, and counting a letter counts it in
either case) -- how the model copes with phrasings it was not trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable

TRAIN_SEED = 0
EVAL_SEED = 20250611  # never used for training

# A few hundred common English words, lowercase, 3-8 letters (sorting uses those of 3-6).
WORDS: tuple[str, ...] = tuple(
    """
    able acid aged also area army away baby back ball band bank base bath bear beat bell belt
    best bird blow blue boat body bone book born boss both bowl bread brick bridge bright brown
    build burn busy cake call calm camp card care cart case cash cast cat chain chair chalk
    cheap check chess chief child city claim class clean clear clock cloud coach coast coat
    code cold color cook cool copy corn cost cotton cover crab cream crowd crown cup cycle
    dance dark date dawn deal deep desk dial diet dirt dish dog door dose dream dress drink
    drive drop drum duck dust eagle early earth east easy edge egg eight empty enemy enjoy
    equal event exam extra face fact fair farm fast father field fifty film find fine fire
    fish five flag flat floor flour flow flower fog fold food foot force forest fork form fox
    frame fresh friend frog fruit full fun game garden gate gift girl glad glass glove goal
    goat gold good grape grass great green grey group guard guest guide hair half hall hand
    happy hard harm hat head heart heat heavy help hero high hill home honey hope horse hotel
    hour house human ice idea inch iron island jacket jam job join joke juice jump key kid king
    kite knee knife lake lamp land large last late laugh lawn leaf left lemon letter level
    life light lime line lion list live lock long loud love lucky lunch magic mail main map
    march mark market mask meal meat melon metal milk mind mint model money month moon motor
    mouse mouth music nail name nest never night noise north nose note ocean offer oil old
    olive onion open orange order owl page paint pair paper park party pasta path peace peach
    pear pen pencil pepper piano pilot pink pipe plan planet plant plate plum pocket point
    pond pool potato power price print prize pump queen quick quiet rabbit radio rain river
    road robot rock roof room root rope rose round ruler salad salt sand scale school sea seed
    shape sheep shell ship shirt shoe shop short silver simple singer sister skirt sky sleep
    slow small smile snake snow soap sock soft song soup south space spoon spring square stamp
    star steam stone storm story street sugar summer sun swan sweet table tail taxi tea team
    tent tiger time toast today tomato tooth towel tower town toy train tree truck tulip
    turtle uncle union upper valley van vase violin voice wall warm watch water wave wheel
    whale white wind window wine winter wolf wood word world yard yellow young zebra zero zoo
    apple banana fig kiwi mango cherry
    animal balloon blanket bicycle cabbage captain chicken diamond dolphin elephant evening
    example feather holiday husband kitchen ladder library machine monkey morning mountain
    network officer orchard package pattern picture pumpkin rainbow sandwich science sunset
    teacher thunder umbrella unicorn village weather whisper yogurt
    """.split()
)
SHORT_WORDS: tuple[str, ...] = tuple(w for w in WORDS if len(w) <= 6)

Exchange = tuple[str, str]


def _number(rng: random.Random) -> int:
    """0-999, with 1-, 2- and 3-digit numbers equally likely."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _finish(rng: random.Random, text: str) -> str:
    """Light surface noise so that casual typing is in distribution."""
    if rng.random() < 0.15:
        text = text[0].lower() + text[1:]
    if rng.random() < 0.15 and text[-1] in ".?":
        text = text[:-1]
    return text


def _op(rng: random.Random, sign: str) -> str:
    return sign if rng.random() < 0.5 else f" {sign} "


def _cased(rng: random.Random, word: str, held_out: bool) -> str:
    """Held out: a word as some people type it, sometimes Capitalised, rarely in CAPITALS
    (training words are lowercase; the training stream draws nothing here)."""
    if not held_out:
        return word
    r = rng.random()
    return word.capitalize() if r < 0.2 else word.upper() if r < 0.3 else word


ADD_PHRASES = (
    "What is {a}{op}{b}?", "Compute {a}{op}{b}.", "Calculate {a}{op}{b}.", "{a}{op}{b} = ?",
    "What's {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
    "{a}{op}{b}", "How much is {a}{op}{b}?", "What is {a} plus {b}?",
)
SUB_PHRASES = (
    "What is {a}{op}{b}?", "Compute {a}{op}{b}.", "Calculate {a}{op}{b}.", "{a}{op}{b} = ?",
    "What's {a} minus {b}?", "Subtract {b} from {a}.", "{a}{op}{b}", "How much is {a}{op}{b}?",
    "What is {a} minus {b}?", "What is {b} subtracted from {a}?",
)

# The held-out templates of each family (``held_out=True``): none is a training template.
ADD_HELD_OUT = (
    "What is the result of adding {a} and {b}?", "Find {a} plus {b}.",
    "How much do {a} and {b} make together?", "Tell me the sum: {a} and {b}",
    "{a} added to {b} is what?", "What number is {a}{op}{b}?",
)
SUB_HELD_OUT = (
    "What is the result of subtracting {b} from {a}?", "Find {a} minus {b}.",
    "How much is left if you take {b} away from {a}?", "Tell me the difference: {a}{op}{b}",
    "{b} subtracted from {a} is what?", "What number is {a}{op}{b}?",
)


def _add(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    q = rng.choice(ADD_HELD_OUT if held_out else ADD_PHRASES).format(a=a, b=b, op=_op(rng, "+"))
    return _finish(rng, q), str(a + b)


def _sub(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    if a < b and rng.random() < 0.75:  # mostly non-negative results, some negative ones
        a, b = b, a
    q = rng.choice(SUB_HELD_OUT if held_out else SUB_PHRASES).format(a=a, b=b, op=_op(rng, "-"))
    return _finish(rng, q), str(a - b)


LARGER_PHRASES = (
    "Which is larger, {a} or {b}?", "Which is bigger: {a} or {b}?",
    "Which number is greater, {a} or {b}?", "What is the larger of {a} and {b}?",
    "Which is more, {a} or {b}?", "max({a}, {b})", "Which is greater: {a} or {b}?",
)
SMALLER_PHRASES = (
    "Which is smaller, {a} or {b}?", "Which is less: {a} or {b}?",
    "Which number is smaller, {a} or {b}?", "What is the smaller of {a} and {b}?",
    "min({a}, {b})", "Which is lower, {a} or {b}?",
)
LARGER_HELD_OUT = (
    "Tell me which is greater, {a} or {b}.", "Between {a} and {b}, which number is bigger?",
    "Which of {a} and {b} is the larger one?", "Give the bigger of {a} and {b}.",
)
SMALLER_HELD_OUT = (
    "Tell me which is less, {a} or {b}.", "Between {a} and {b}, which number is smaller?",
    "Which of {a} and {b} is the smaller one?", "Give the lower of {a} and {b}.",
)


def _close_to(rng: random.Random, a: int) -> int:
    """A different number that is easy to confuse with ``a`` (digits swapped, or near)."""
    s = str(a)
    if len(s) > 1 and rng.random() < 0.5:
        i, j = rng.sample(range(len(s)), 2)
        t = list(s)
        t[i], t[j] = t[j], t[i]
        if t[0] != "0" and "".join(t) != s:
            return int("".join(t))
    return min(999, max(0, a + rng.choice((-1, 1)) * rng.randint(1, 20)))


def _compare(rng: random.Random, held_out: bool) -> Exchange:
    a = _number(rng)
    b = _close_to(rng, a) if rng.random() < 0.5 else _number(rng)
    while b == a:
        b = _number(rng)
    if rng.random() < 0.6:
        q, ans = rng.choice(LARGER_HELD_OUT if held_out else LARGER_PHRASES), max(a, b)
    else:
        q, ans = rng.choice(SMALLER_HELD_OUT if held_out else SMALLER_PHRASES), min(a, b)
    return _finish(rng, q.format(a=a, b=b)), str(ans)


REVERSE_PHRASES = (
    "Reverse the word: {w}", "Reverse the word {w}.", "Spell {w} backwards.",
    "What is {w} reversed?", "Write '{w}' backwards.", "reverse {w}", "Reverse '{w}'.",
    "Spell the word {w} backwards.",
)
REVERSE_HELD_OUT = (
    "Please write the word '{w}' backwards.", "What do you get if you reverse {w}?",
    "Give me {w} spelled backwards.", "Reverse the order of the letters in {w}.",
)


def _reverse(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS), held_out)
    q = rng.choice(REVERSE_HELD_OUT if held_out else REVERSE_PHRASES)
    return _finish(rng, q.format(w=w)), w[::-1]


SORT_PHRASES = (
    "Sort these words: {ws}", "Sort alphabetically: {ws}",
    "Put these words in alphabetical order: {ws}", "Sort the words {ws} alphabetically.",
    "Arrange in alphabetical order: {ws}", "sort: {ws}", "Sort these words alphabetically: {ws}",
)
SORT_HELD_OUT = (
    "Please put the words {ws} in alphabetical order.", "Sort this list of words: {ws}",
    "Give these words in alphabetical order: {ws}", "In alphabetical order, {ws} are?",
)


def _sort(rng: random.Random, held_out: bool) -> Exchange:
    words = [_cased(rng, w, held_out) for w in rng.sample(SHORT_WORDS, rng.randint(3, 5))]
    q = rng.choice(SORT_HELD_OUT if held_out else SORT_PHRASES).format(ws=", ".join(words))
    return _finish(rng, q), ", ".join(sorted(words, key=str.lower))


LENGTH_PHRASES = (
    "How many letters are in '{w}'?", "How many letters does {w} have?",
    "How many letters are in the word {w}?", "Count the letters in {w}.",
    "What is the length of the word '{w}'?", "How long is the word {w}?",
)
OCCURRENCE_PHRASES = (
    "How many times does the letter {c} appear in '{w}'?", "How many {c}'s are in {w}?",
    "Count the letter {c} in {w}.", "How many times does {c} occur in the word {w}?",
)
LENGTH_HELD_OUT = (
    "Tell me how many letters the word {w} has.", "How many letters make up '{w}'?",
    "What is the letter count of {w}?",
)
OCCURRENCE_HELD_OUT = (
    "In the word '{w}', how many times does the letter {c} appear?",
    "Tell me how many {c}'s the word {w} has.", "How many letters {c} are in '{w}'?",
)


def _count(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS), held_out)
    if rng.random() < 0.5:
        q = rng.choice(LENGTH_HELD_OUT if held_out else LENGTH_PHRASES)
        return _finish(rng, q.format(w=w)), str(len(w))
    c = rng.choice(w.lower()) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    q = rng.choice(OCCURRENCE_HELD_OUT if held_out else OCCURRENCE_PHRASES)
    return _finish(rng, q.format(c=c, w=w)), str(w.lower().count(c))


GREETINGS = ("Hello", "Hi", "Hello!", "Hi!", "Hey", "Help", "What can you do?",
             "Who are you?", "help")
GREETING_ANSWER = ("Hi! I can add and subtract numbers, compare them, and reverse, sort or "
                   "count the letters of words.")


def _greeting(rng: random.Random, held_out: bool) -> Exchange:
    return rng.choice(GREETINGS), GREETING_ANSWER


FAMILIES: dict[str, Callable[[random.Random, bool], Exchange]] = {
    "add": _add,
    "sub": _sub,
    "compare": _compare,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "greeting": _greeting,
}
# The families the evaluation scores (the greeting is a fixed reply, trained but not scored).
EVAL_FAMILIES: tuple[str, ...] = ("add", "sub", "compare", "reverse", "sort", "count")


def generate(family: str, n: int, seed: int, held_out: bool = False) -> list[Exchange]:
    """``n`` exchanges ``(question, answer)`` of ``family``, the same for the same arguments.
    ``held_out``: in the held-out phrasings (the greeting has none: the same exchanges)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"dllm-tasks:{family}:{seed}" + (":held-out" if held_out else ""))
    return [FAMILIES[family](rng, held_out) for _ in range(n)]
