"""Synthetic GSM8K-style math word problems with step-by-step solutions (own templates, CC0).

`problem(rng)` returns (question, steps, answer): steps are short sentences that each state
one computation ("3 * 4 = 12"), answer is an int. Everything is drawn from `rng`, so a seed
reproduces the corpus.
"""

import random
import re

NAMES = ("Ava Ben Carla Dev Elena Farid Grace Hugo Ines Jamal Kira Liam Maya Noah Olga Pedro "
         "Quinn Rosa Sam Tara Umar Vera Will Xena Yusuf Zoe Aiko Bruno Chen Dana Emil Fatima "
         "Gabe Hana Ivan Julia Kofi Lena Marco Nina Omar Priya Ravi Sofia Tom Uma Victor Wen "
         "Yara Zack").split()
FRUITS = "apples oranges pears peaches lemons plums mangoes bananas".split()
GOODS = [("notebook", "notebooks"), ("pencil", "pencils"), ("shirt", "shirts"),
         ("book", "books"), ("toy car", "toy cars"), ("candle", "candles"), ("mug", "mugs"),
         ("ticket", "tickets"), ("puzzle", "puzzles"), ("plant", "plants"), ("hat", "hats")]
ANIMALS = [("hen", "eggs"), ("cow", "liters of milk"), ("goat", "liters of milk"),
           ("duck", "eggs")]
BAKED = ["cookies", "muffins", "cupcakes", "brownies", "pies", "loaves of bread"]
PLACES = ["the park", "the library", "the store", "the beach", "school", "the museum", "the farm"]
VEHICLES = ["car", "bus", "train", "bike", "truck"]


def _name(rng, k=1):
    return rng.sample(NAMES, k) if k > 1 else rng.choice(NAMES)


def _money(x: int) -> str:
    return f"${x}"


def t_change(rng):
    n, (_, many) = _name(rng), rng.choice(GOODS)
    k, p = rng.randint(2, 9), rng.randint(2, 15)
    bill = next(b for b in (20, 50, 100, 200) if b > k * p)
    q = (f"{n} buys {k} {many} that cost {_money(p)} each. {n} pays with a {_money(bill)} bill. "
         f"How much change does {n} get?")
    s = [f"The {many} cost {k} * {p} = {_money(k * p)}.",
         f"The change is {bill} - {k * p} = {_money(bill - k * p)}."]
    return q, s, bill - k * p


def t_farm(rng):
    n, (animal, product) = _name(rng), rng.choice(ANIMALS)
    a, per = rng.randint(3, 12), rng.randint(2, 6)
    use1, use2, price = rng.randint(1, 5), rng.randint(1, 5), rng.randint(2, 5)
    total = a * per
    if total <= use1 + use2:
        a = (use1 + use2) // per + 2
        total = a * per
    left = total - use1 - use2
    q = (f"{n} has {a} {animal}s. Each {animal} gives {per} {product} a day. {n} uses {use1} "
         f"for breakfast and {use2} for baking every day, and sells the rest for {_money(price)} "
         f"each. How much money does {n} make every day?")
    s = [f"The {animal}s give {a} * {per} = {total} {product} a day.",
         f"{n} uses {use1} + {use2} = {use1 + use2} of them.",
         f"So {n} sells {total} - {use1 + use2} = {left}.",
         f"{n} makes {left} * {price} = {_money(left * price)} a day."]
    return q, s, left * price


def t_weekly(rng):
    n = _name(rng)
    a, b, c = rng.randint(2, 6), rng.randint(2, 5), rng.choice([20, 40, 50, 60, 80, 100, 120])
    q = (f"{n} runs {a} sprints {b} times a week. Each sprint is {c} meters long. "
         f"How many meters does {n} run in a week?")
    s = [f"{n} runs {a} * {b} = {a * b} sprints a week.",
         f"That is {a * b} * {c} = {a * b * c} meters."]
    return q, s, a * b * c


def t_savings(rng):
    n, (one, _) = _name(rng), rng.choice(GOODS)
    w, k = rng.randint(5, 30), rng.randint(3, 12)
    c = rng.randint(5, w * k - 1)
    q = (f"{n} saves {_money(w)} every week for {k} weeks. Then {n} spends {_money(c)} on a "
         f"{one}. How much money does {n} have left?")
    s = [f"{n} saves {w} * {k} = {_money(w * k)}.",
         f"After buying the {one}, {n} has {w * k} - {c} = {_money(w * k - c)} left."]
    return q, s, w * k - c


def t_fraction(rng):
    n, m = _name(rng, 2)
    d = rng.choice([2, 3, 4, 5])
    total = d * rng.randint(4, 20)
    lost = rng.randint(1, total // d)
    give = total // d
    q = (f"{n} has {total} marbles. {n} gives 1/{d} of them to {m} and then loses {lost}. "
         f"How many marbles does {n} have now?")
    s = [f"{n} gives away {total} / {d} = {give} marbles.",
         f"{n} keeps {total} - {give} = {total - give} marbles.",
         f"After losing {lost}, {n} has {total - give} - {lost} = {total - give - lost} marbles."]
    return q, s, total - give - lost


def t_discount(rng):
    n, (one, _) = _name(rng), rng.choice(GOODS)
    d = rng.choice([10, 20, 25, 30, 50])
    p = rng.randint(1, 8) * 40 if d == 25 else rng.randint(2, 30) * 10
    off = p * d // 100
    q = f"A {one} costs {_money(p)}. It is on sale for {d}% off. How much does {n} pay for it?"
    s = [f"The discount is {p} * {d} / 100 = {_money(off)}.",
         f"{n} pays {p} - {off} = {_money(p - off)}."]
    return q, s, p - off


def t_ages(rng):
    a, b = _name(rng, 2)
    yb, diff, later = rng.randint(4, 30), rng.randint(2, 15), rng.randint(2, 10)
    q = (f"{a} is {diff} years older than {b}. {b} is {yb} years old. What will be the sum "
         f"of their ages in {later} years?")
    ya = yb + diff
    s = [f"{a} is {yb} + {diff} = {ya} years old.",
         f"In {later} years {a} will be {ya} + {later} = {ya + later}.",
         f"In {later} years {b} will be {yb} + {later} = {yb + later}.",
         f"The sum is {ya + later} + {yb + later} = {ya + yb + 2 * later}."]
    return q, s, ya + yb + 2 * later


def t_distance(rng):
    n, v = _name(rng), rng.choice(VEHICLES)
    s1, h1, s2, h2 = rng.randint(3, 12) * 5, rng.randint(1, 4), rng.randint(3, 12) * 5, rng.randint(1, 4)
    q = (f"{n} travels by {v} at {s1} miles per hour for {h1} hours, then at {s2} miles per "
         f"hour for {h2} hours. How many miles does {n} travel in total?")
    s = [f"First part: {s1} * {h1} = {s1 * h1} miles.",
         f"Second part: {s2} * {h2} = {s2 * h2} miles.",
         f"Total: {s1 * h1} + {s2 * h2} = {s1 * h1 + s2 * h2} miles."]
    return q, s, s1 * h1 + s2 * h2


def t_compare(rng):
    a, b, c = _name(rng, 3)
    f = rng.choice(FRUITS)
    x, k, m = rng.randint(3, 15), rng.randint(2, 4), rng.randint(1, 5)
    q = (f"{a} has {x} {f}. {b} has {k} times as many {f} as {a}. {c} has {m} fewer {f} than "
         f"{b}. How many {f} do they have together?")
    s = [f"{b} has {x} * {k} = {x * k} {f}.",
         f"{c} has {x * k} - {m} = {x * k - m} {f}.",
         f"Together they have {x} + {x * k} + {x * k - m} = {x + 2 * x * k - m} {f}."]
    return q, s, x + 2 * x * k - m


def t_recipe(rng):
    n, item = _name(rng), rng.choice(BAKED)
    a, b = rng.randint(2, 5), rng.randint(2, 8)
    c = rng.randint(1, a * b - 1)
    q = (f"A recipe for {item} needs {a} cups of flour per batch. {n} wants to make {b} batches "
         f"and has {c} cups of flour. How many more cups of flour does {n} need?")
    s = [f"{b} batches need {a} * {b} = {a * b} cups of flour.",
         f"{n} needs {a * b} - {c} = {a * b - c} more cups."]
    return q, s, a * b - c


def t_pages(rng):
    n = _name(rng)
    r, d, rest = rng.randint(5, 40), rng.randint(2, 9), rng.randint(2, 9)
    pages = r * (d + rest)
    q = (f"A book has {pages} pages. {n} reads {r} pages a day. After {d} days, how many more "
         f"days does {n} need to finish the book?")
    s = [f"In {d} days {n} reads {r} * {d} = {r * d} pages.",
         f"There are {pages} - {r * d} = {pages - r * d} pages left.",
         f"That takes {pages - r * d} / {r} = {rest} more days."]
    return q, s, rest


def t_class(rng):
    n_st = rng.choice([20, 24, 25, 30, 32, 36, 40, 50])
    p = rng.choice([p for p in (10, 20, 25, 40, 50, 60, 75, 80) if n_st * p % 100 == 0] or [50])
    girls = n_st * p // 100
    q = f"A class has {n_st} students and {p}% of them are girls. How many boys are in the class?"
    s = [f"There are {n_st} * {p} / 100 = {girls} girls.",
         f"So there are {n_st} - {girls} = {n_st - girls} boys."]
    return q, s, n_st - girls


def t_shopping(rng):
    n = _name(rng)
    (o1, m1), (o2, m2) = rng.sample(GOODS, 2)
    a, x, b, y = rng.randint(2, 6), rng.randint(2, 20), rng.randint(2, 6), rng.randint(2, 20)
    q = (f"{n} buys {a} {m1} for {_money(x)} each and {b} {m2} for {_money(y)} each. "
         f"How much does {n} spend in total?")
    s = [f"The {m1} cost {a} * {x} = {_money(a * x)}.",
         f"The {m2} cost {b} * {y} = {_money(b * y)}.",
         f"In total {n} spends {a * x} + {b * y} = {_money(a * x + b * y)}."]
    return q, s, a * x + b * y


def t_overtime(rng):
    n = _name(rng)
    w, h = rng.randint(5, 20) * 2, rng.randint(41, 55)
    over = h - 40
    q = (f"{n} earns {_money(w)} an hour and gets 1.5 times that rate for every hour over 40 "
         f"in a week. How much does {n} earn for working {h} hours in a week?")
    s = [f"Regular pay: 40 * {w} = {_money(40 * w)}.",
         f"The overtime rate is {w} * 1.5 = {_money(w * 3 // 2)} an hour.",
         f"{n} works {h} - 40 = {over} overtime hours.",
         f"Overtime pay: {over} * {w * 3 // 2} = {_money(over * w * 3 // 2)}.",
         f"Total: {40 * w} + {over * w * 3 // 2} = {_money(40 * w + over * w * 3 // 2)}."]
    return q, s, 40 * w + over * w * 3 // 2


def t_share(rng):
    n, item = _name(rng), rng.choice(BAKED)
    k, each, eat = rng.randint(2, 8), rng.randint(3, 12), rng.randint(1, 2)
    total = k * each
    q = (f"{n} bakes {total} {item} and shares them equally among {k} friends. Each friend "
         f"eats {eat} right away. How many {item} does each friend have left?")
    s = [f"Each friend gets {total} / {k} = {each} {item}.",
         f"After eating {eat}, each friend has {each} - {eat} = {each - eat} left."]
    return q, s, each - eat


def t_profit(rng):
    n, (_, many) = _name(rng), rng.choice(GOODS)
    k, cost, price = rng.randint(10, 60), rng.randint(2, 9), rng.randint(10, 25)
    rent = rng.randint(5, max(6, k * (price - cost) // 2))
    q = (f"{n} makes {k} {many} at a cost of {_money(cost)} each and sells all of them for "
         f"{_money(price)} each. The stall at {rng.choice(PLACES)} costs {_money(rent)}. "
         f"What is {n}'s profit?")
    s = [f"Income: {k} * {price} = {_money(k * price)}.",
         f"Material cost: {k} * {cost} = {_money(k * cost)}.",
         f"Profit: {k * price} - {k * cost} - {rent} = {_money(k * price - k * cost - rent)}."]
    return q, s, k * price - k * cost - rent


def t_time(rng):
    n, place = _name(rng), rng.choice(PLACES)
    a, b, c = rng.randint(10, 50), rng.randint(10, 90), rng.randint(5, 40)
    q = (f"{n} walks to {place} in {a} minutes, stays there for {b} minutes and takes {c} "
         f"minutes to get home. How many minutes is {n} away from home?")
    s = [f"The trip takes {a} + {b} + {c} = {a + b + c} minutes."]
    return q, s, a + b + c


def t_rooms(rng):
    n = _name(rng)
    r, w, l, price = rng.randint(2, 5), rng.randint(3, 8), rng.randint(3, 9), rng.randint(2, 6)
    area = w * l
    q = (f"{n} wants new carpet in {r} rooms. Each room is {w} meters by {l} meters. Carpet "
         f"costs {_money(price)} per square meter. How much will the carpet cost?")
    s = [f"One room is {w} * {l} = {area} square meters.",
         f"{r} rooms are {r} * {area} = {r * area} square meters.",
         f"The carpet costs {r * area} * {price} = {_money(r * area * price)}."]
    return q, s, r * area * price


def t_half(rng):
    n, (one, _) = _name(rng), rng.choice(GOODS)
    a = 2 * rng.randint(2, 20)
    q = (f"{n} needs {a} meters of red ribbon for a {one} and half as much green ribbon. "
         f"How many meters of ribbon does {n} need in total?")
    s = [f"The green ribbon is {a} / 2 = {a // 2} meters.",
         f"In total {n} needs {a} + {a // 2} = {a + a // 2} meters."]
    return q, s, a + a // 2


def t_value_up(rng):
    n = _name(rng)
    thing = rng.choice(["house", "painting", "bike", "coin collection", "vintage car"])
    p, pct = rng.randint(2, 40) * 1000, rng.choice([10, 20, 25, 50, 100, 150])
    rise = p * pct // 100
    fix = rise * rng.randint(1, 3) // 4
    q = (f"{n} buys a {thing} for {_money(p)} and spends {_money(fix)} fixing it up. This raises its "
         f"value by {pct}% of the price {n} paid. How much profit does {n} make by selling it?")
    s = [f"The value goes up by {p} * {pct} / 100 = {_money(rise)}.",
         f"So the {thing} is worth {p} + {rise} = {_money(p + rise)}.",
         f"{n} spent {p} + {fix} = {_money(p + fix)} in total.",
         f"The profit is {p + rise} - {p + fix} = {_money(rise - fix)}."]
    return q, s, rise - fix


def t_daily(rng):
    n = _name(rng)
    verb, what = rng.choice([("drinks", "glasses of water"), ("reads", "pages"),
                             ("does", "push-ups"), ("drinks", "cups of tea"),
                             ("practices", "minutes of piano")])
    a, w = rng.randint(2, 12), rng.randint(2, 6)
    q = f"{n} {verb} {a} {what} every day. How many {what} is that in {w} weeks?"
    s = [f"{w} weeks have {w} * 7 = {w * 7} days.",
         f"{n} {verb} {a} * {w * 7} = {a * w * 7} {what}."]
    return q, s, a * w * 7


def t_meals(rng):
    n = _name(rng)
    k, per = rng.randint(5, 30), rng.randint(2, 4)
    total = k * per
    m1 = rng.randint(1, total // 2)
    m2 = rng.randint(1, total - m1 - 1)
    q = (f"{n} feeds each of {k} rabbits {per} cups of food a day, in three meals. In the morning "
         f"{n} gives them {m1} cups and in the afternoon {m2} cups. How many cups does {n} give "
         f"them in the evening?")
    s = [f"The rabbits need {k} * {per} = {total} cups a day.",
         f"Morning and afternoon give {m1} + {m2} = {m1 + m2} cups.",
         f"The evening meal is {total} - {m1 + m2} = {total - m1 - m2} cups."]
    return q, s, total - m1 - m2


def t_babysit(rng):
    n = _name(rng)
    h, k = rng.randint(2, 10), rng.choice([2, 4, 5])
    rate = k * rng.randint(2, 20 // k + 1)
    earned = rate * h
    q = (f"{n} earns {_money(rate)} an hour babysitting and works {h} hours this week. {n} "
         f"spends 1/{k} of the money on a gift. How much money does {n} have left?")
    s = [f"{n} earns {rate} * {h} = {_money(earned)}.",
         f"The gift costs {earned} / {k} = {_money(earned // k)}.",
         f"{n} has {earned} - {earned // k} = {_money(earned - earned // k)} left."]
    return q, s, earned - earned // k


def t_speed(rng):
    v = rng.choice(VEHICLES)
    speed, h, h2 = rng.randint(3, 15) * 5, rng.randint(2, 5), rng.randint(2, 9)
    q = (f"A {v} travels {speed * h} miles in {h} hours. At the same speed, how many miles does "
         f"it travel in {h2} hours?")
    s = [f"The speed is {speed * h} / {h} = {speed} miles per hour.",
         f"In {h2} hours it travels {speed} * {h2} = {speed * h2} miles."]
    return q, s, speed * h2


_NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
_SMALL = re.compile(r"(?<![$\d./])\b([1-9]|1[0-2])\b(?![\d./%])")
_CONTEXT = ["It is a busy week.", "Everyone in the family helps out.", "The weather is nice today.",
            "{n} likes to plan ahead.", "{n} keeps careful track of everything.",
            "Last month {n} started a new hobby.", "{n} is getting ready for the weekend.",
            "Every morning, {n} makes a list."]


def _vary(q: str, rng: random.Random) -> str:
    """Surface variation: number words, a context sentence, GSM8K-like double spaces."""
    if rng.random() < 0.3:
        q = _SMALL.sub(lambda m: _NUMBER_WORDS[int(m.group(1))] if rng.random() < 0.5 else m.group(1), q)
    if rng.random() < 0.4:
        who = next((w for w in re.findall(r"[A-Z][a-z]+", q) if w in NAMES), "Sam")
        q = rng.choice(_CONTEXT).format(n=who) + " " + q
    if rng.random() < 0.2:
        q = q.replace(". ", ".  ")
    return q


TEMPLATES = [t_change, t_farm, t_weekly, t_savings, t_fraction, t_discount, t_ages, t_distance,
             t_compare, t_recipe, t_pages, t_class, t_shopping, t_overtime, t_share, t_profit,
             t_time, t_rooms, t_half, t_value_up, t_daily, t_meals, t_babysit, t_speed]


def problem(rng: random.Random) -> tuple[str, list[str], int]:
    """One random problem: (question, solution steps, integer answer)."""
    q, steps, ans = rng.choice(TEMPLATES)(rng)
    return _vary(q, rng), steps, ans


def raw_text(rng: random.Random) -> str:
    """A problem as plain text in the GSM8K layout: question, steps, '#### answer'."""
    q, steps, ans = problem(rng)
    return f"Question: {q}\nAnswer: " + "\n".join(steps) + f"\n#### {ans}"
