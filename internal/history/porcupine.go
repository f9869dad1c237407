package history

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/anishathalye/porcupine"
)

func addSorted(list, v string) string {
	items := splitSorted(list)
	if i, ok := slices.BinarySearch(items, v); !ok {
		items = slices.Insert(items, i, v)
	}
	return strings.Join(items, "\x00")
}

func hasSorted(list, v string) bool {
	_, ok := slices.BinarySearch(splitSorted(list), v)
	return ok
}

func splitSorted(list string) []string {
	if list == "" {
		return nil
	}
	return strings.Split(list, "\x00")
}

// Model is the contract as a porcupine model. It is nondeterministic (an operation whose
// outcome is unknown may have done several things), so its state is the set of states the key
// may be in, without the states another one dominates (one that allows at least as much from
// then on), sorted so that equal sets are equal slices. Its operations' Input and Output are
// Input and Output; Partition splits a history by Input.Key.
func Model() porcupine.Model { return relaxing(0) }

// relaxing is the model with the rules in relaxed not enforced.
func relaxing(relaxed rule) porcupine.Model {
	return porcupine.Model{
		Partition: partition,
		Init:      func() interface{} { return []state{{}} },
		Step: func(set, in, out interface{}) (bool, interface{}) {
			st := stepper{relaxed: relaxed}
			var next []state
			for _, s := range set.([]state) {
				next = append(next, st.step(s, in.(Input), out.(Output))...)
			}
			next = prune(next)
			return len(next) > 0, next
		},
		Equal: func(a, b interface{}) bool { return slices.Equal(a.([]state), b.([]state)) },
		Hash: func(set interface{}) uint64 {
			var h uint64
			for _, s := range set.([]state) {
				h = h*1099511628211 + s.hash()
			}
			return h
		},
		DescribeOperation: func(in, out interface{}) string { return describeOp(in.(Input), out.(Output)) },
		DescribeState:     func(set interface{}) string { return describeStates(set.([]state)) },
	}
}

// dominates tells whether every history legal from b is legal from a: the same but for an
// earlier bound (since), more generations whose effect nobody saw, and the generation number,
// which only names generations.
func (a state) dominates(b state) bool {
	return a.phase == b.phase && (a.gen > 0) == (b.gen > 0) && a.fp == b.fp && a.ttl == b.ttl &&
		a.pastEffects == b.pastEffects && a.since <= b.since && a.pastUnknown >= b.pastUnknown &&
		// an answer, a provider key or an effect not seen yet binds to anything later
		(a.answer == b.answer || a.answer == unknown) && (a.pk == b.pk || a.pk == "") &&
		(a.effect == b.effect || (a.effect == unknown && b.effect == "")) &&
		(a.releasable || !b.releasable) && subset(a.pastPKs, b.pastPKs)
}

// subset tells whether every item of the sorted list a is in the sorted list b.
func subset(a, b string) bool {
	if a == b || a == "" {
		return true
	}
	for _, item := range splitSorted(a) {
		if !hasSorted(b, item) {
			return false
		}
	}
	return true
}

// prune drops the states another one dominates (of two that dominate each other, the later
// generation), and sorts the rest.
func prune(states []state) []state {
	var out []state
	for i, s := range states {
		keep := true
		for j, o := range states {
			if i == j || !o.dominates(s) {
				continue
			}
			if !s.dominates(o) || o.gen < s.gen || (o.gen == s.gen && j < i) {
				keep = false
				break
			}
		}
		if keep {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b state) int {
		if c := cmp.Compare(a.hash(), b.hash()); c != 0 {
			return c
		}
		return cmp.Compare(a.gen, b.gen)
	})
	return out
}

func partition(ops []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range ops {
		k := op.Input.(Input).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	out := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		out = append(out, byKey[k])
	}
	return out
}

func describeOp(in Input, out Output) string {
	if out.Outcome == Observed {
		return fmt.Sprintf("effects afterwards: %v", out.Effects)
	}
	s := fmt.Sprintf("c%d %s → %s", in.Client, short(in.Request, 60), out.Outcome)
	if out.Status != 0 {
		s += fmt.Sprintf(" %d", out.Status)
	}
	if out.Outcome == Answered || out.Outcome == Replayed {
		s += " " + short(out.Body, 80)
	}
	if out.ProviderKey != "" {
		s += " pk=" + short(out.ProviderKey, 12)
	}
	if out.Note != "" {
		s += " (" + short(out.Note, 60) + ")"
	}
	return s
}
