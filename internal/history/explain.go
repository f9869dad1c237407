package history

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Causes says which promises a key's illegal history breaks: the rules whose relaxation alone
// (or, when none does, together with one other) makes it legal, among those the first
// operation that fits nowhere was refused by. Empty when the history is legal, or when no such
// rule or pair explains it.
func Causes(ops []porcupine.Operation, timeout time.Duration) []string {
	_, causes, _ := explain(ops, nil, timeout)
	return causes
}

// causesOf tries the candidate rules alone, then, when none is enough, each with any other
// rule; first without relaxing ruleAnswer, which explains too much (a replay that may be wrong
// tells nothing, so every history with a suspicious replay becomes legal), then with it.
func causesOf(ops []porcupine.Operation, candidates rule, timeout time.Duration) []string {
	legalWithout := func(r rule) bool {
		return porcupine.CheckOperationsTimeout(relaxing(r), ops, timeout) == porcupine.Ok
	}
	var every rule
	for _, k := range ruleKinds {
		every |= k.r
	}
	for _, allowed := range []rule{every &^ ruleAnswer, every} {
		var kinds []string
		for _, k := range ruleKinds {
			if candidates&allowed&k.r != 0 && legalWithout(k.r) {
				kinds = append(kinds, k.kind)
			}
		}
		if len(kinds) > 0 {
			return kinds
		}
		tried := map[rule]bool{}
		for _, k := range ruleKinds {
			if candidates&allowed&k.r == 0 {
				continue
			}
			for _, o := range ruleKinds {
				pair := k.r | o.r
				if o.r == k.r || allowed&o.r == 0 || tried[pair] {
					continue
				}
				tried[pair] = true
				if legalWithout(pair) {
					kinds = append(kinds, kindsOf(pair))
				}
			}
		}
		if len(kinds) > 0 {
			return kinds
		}
	}
	return nil
}

// kindsOf names the rules in r, joined with " and ".
func kindsOf(r rule) string {
	var names []string
	for _, k := range ruleKinds {
		if r&k.r != 0 {
			names = append(names, k.kind)
		}
	}
	return strings.Join(names, " and ")
}

// Timeline explains one key's history: one line per operation in call order (call and
// return times since the history began, the client, the request, what it learned, the
// generation the longest linearization placed it in), the faults that overlapped it, and,
// when it is illegal, which promises it breaks (Causes) and why the operations no
// linearization could place fit nowhere.
func Timeline(ops []porcupine.Operation, faults []Fault) string {
	timeline, _, _ := explain(ops, faults, 30*time.Second)
	return timeline
}

// explain is Timeline, with the causes of a violation (none for a legal key) and porcupine's
// verdict.
func explain(ops []porcupine.Operation, faults []Fault, timeout time.Duration) (string, []string, porcupine.CheckResult) {
	result, info := porcupine.CheckOperationsVerbose(Model(), ops, timeout)
	var longest []int
	if partials := info.PartialLinearizations(); len(partials) > 0 {
		for _, l := range partials[0] {
			if len(l) > len(longest) {
				longest = l
			}
		}
	}
	// Replay the model along the longest linearization: the generations each operation may
	// be in, and the states at the end.
	states := []state{{}}
	gens := map[int]string{}
	placed := map[int]bool{}
	for _, id := range longest {
		in, out := ops[id].Input.(Input), ops[id].Output.(Output)
		var next []state
		for _, s := range states {
			n, _ := step(s, in, out)
			next = append(next, n...)
		}
		states = prune(next)
		placed[id] = true
		var g []int
		for _, s := range states {
			if s.gen > 0 && !slices.Contains(g, s.gen) {
				g = append(g, s.gen)
			}
		}
		slices.Sort(g)
		gens[id] = strings.Trim(strings.Join(strings.Fields(fmt.Sprint(g)), "|"), "[]")
	}
	order := make([]int, len(ops))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return int(ops[a].Call - ops[b].Call) })
	// Why each operation that fits nowhere was refused, from the states the placed ones left;
	// the rules that refused the first of them are the candidate causes.
	reasons := map[int][]reason{}
	var candidates, all rule
	if result == porcupine.Illegal {
		for _, id := range order {
			if placed[id] {
				continue
			}
			for _, s := range states {
				st := stepper{}
				if len(st.step(s, ops[id].Input.(Input), ops[id].Output.(Output))) == 0 {
					reasons[id] = append(reasons[id], st.why...)
				}
			}
			first := candidates == 0
			for _, r := range reasons[id] {
				all |= r.r
				if first {
					candidates |= r.r
				}
			}
		}
		if candidates == 0 {
			candidates = all
		}
		if candidates == 0 {
			for _, k := range ruleKinds {
				candidates |= k.r
			}
		}
	}
	var b strings.Builder
	in0 := ops[0].Input.(Input)
	verdict := "linearizable"
	var causes []string
	switch result {
	case porcupine.Illegal:
		verdict = fmt.Sprintf("NOT linearizable; %d of %d operations placed", len(longest), len(ops))
		causes = causesOf(ops, candidates, min(timeout, 5*time.Second))
	case porcupine.Unknown:
		verdict = "undecided (porcupine timed out)"
	}
	fmt.Fprintf(&b, "key %s: %s (%s route, TTL %s, clock slack %s)\n", in0.Key, verdict, in0.Route, in0.TTL, ClockSlack)
	if len(causes) > 0 {
		fmt.Fprintf(&b, "   breaks: %s (the model accepts the history once that is allowed)\n", strings.Join(causes, "; or "))
	}
	for _, id := range order {
		in, out := ops[id].Input.(Input), ops[id].Output.(Output)
		mark := "   "
		if !placed[id] {
			mark = " ✗ "
		}
		ret := at(int64(out.Return))
		if out.Outcome == Unknown {
			ret = fmt.Sprintf("(gave up %s)", at(int64(out.GaveUp)))
		}
		gen := "gen " + gens[id]
		if !placed[id] {
			gen = "not placed"
		}
		if out.Outcome == Observed {
			fmt.Fprintf(&b, "%s%s  effects afterwards: %v  [%s]\n", mark, at(int64(in.Call)), out.Effects, gen)
			continue
		}
		fmt.Fprintf(&b, "%s%s → %-17s c%-3d %-5s %-46s ⇒ %s  [%s]\n", mark, at(int64(in.Call)), ret, in.Client, in.Route,
			short(in.Request, 46), describeOutput(out), gen)
	}
	from, to := window(ops)
	for _, f := range faults {
		if int64(f.To) >= from && int64(f.From) <= to {
			fmt.Fprintf(&b, "   fault %s → %s  %s: %s\n", at(int64(f.From)), at(int64(f.To)), f.Kind, f.Detail)
		}
	}
	if result != porcupine.Illegal {
		return b.String(), nil, result
	}
	fmt.Fprintf(&b, "   state after the placed operations: %s\n", describeStates(states))
	causeRules := rule(0)
	for _, k := range ruleKinds {
		for _, c := range causes {
			if strings.Contains(c, k.kind) {
				causeRules |= k.r
			}
		}
	}
	for _, id := range order {
		if placed[id] {
			continue
		}
		in, out := ops[id].Input.(Input), ops[id].Output.(Output)
		var why, other []string
		for _, r := range reasons[id] {
			if causeRules == 0 || r.r&causeRules != 0 {
				why = append(why, r.text)
			} else {
				other = append(other, r.text)
			}
		}
		if len(why) == 0 {
			why = other
		}
		slices.Sort(why)
		why = slices.Compact(why)
		if len(why) == 0 {
			why = []string{"it fits, but only in an order the call and return times forbid"}
		}
		fmt.Fprintf(&b, "   why c%d at %s (%s) fits nowhere: %s\n", in.Client, at(int64(in.Call)), out.Outcome, strings.Join(why, "; "))
	}
	return b.String(), causes, result
}

func describeOutput(out Output) string {
	s := out.Outcome.String()
	if out.Status != 0 {
		s += fmt.Sprintf(" %d", out.Status)
	}
	if out.Outcome == Answered || out.Outcome == Replayed {
		s += " " + short(out.Body, 90)
	}
	if out.ProviderKey != "" {
		s += " pk=" + short(out.ProviderKey, 12)
	}
	if out.Note != "" {
		s += " (" + short(out.Note, 70) + ")"
	}
	return s
}

func describeStates(states []state) string {
	var d []string
	for i, s := range states {
		if i == 4 {
			d = append(d, fmt.Sprintf("and %d more", len(states)-i))
			break
		}
		d = append(d, s.describe())
	}
	return "{" + strings.Join(d, "; ") + "}"
}
