package history

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"
)

// Verify checks the run's history (closed and observed), logs the counts, and fails the
// test with the timelines of the keys that violate the model (grouped by what they violate),
// and of the retrying clients that did not converge in time (liveness), and where their
// artifacts are.
func Verify(t testing.TB, h *History, name string) Result {
	t.Helper()
	res := Check(h, Options{Name: name})
	outcomes, faults := h.Counts()
	t.Logf("%s: %d keys; %s", name, res.Keys, Summary(outcomes, faults))
	t.Logf("%s: checked in %s (the slowest key, %s, in %s)", name, res.Took.Round(time.Millisecond), res.Slowest,
		res.SlowestTook.Round(time.Millisecond))
	if res.Chains > 0 {
		t.Logf("%s: liveness: %d retrying clients checked, %d excused by a fault, %d late or without the answer", name,
			res.Chains, res.Excused, len(res.Liveness))
	}
	if len(res.Inconclusive) > 0 {
		t.Errorf("porcupine could not decide %d keys in time: %v", len(res.Inconclusive), res.Inconclusive)
	}
	if len(res.Violations) > 0 {
		t.Error(report(fmt.Sprintf("%d of %d keys violate the idempotency contract (artifacts: %s):\n", len(res.Violations),
			res.Keys, res.Dir), "keys", res.Violations))
	}
	if len(res.Liveness) > 0 {
		t.Error(report(fmt.Sprintf("%d of %d retrying clients did not converge in time (artifacts: %s, liveness.txt):\n",
			len(res.Liveness), res.Chains, res.Dir), "clients", res.Liveness))
	}
	return res
}

// report groups violations by what they break: a header line, a count per group, then the
// first two timelines of each group.
func report(header, what string, vs []Violation) string {
	groups := map[string][]Violation{}
	for _, v := range vs {
		kind := strings.Join(v.Kinds, "; or ")
		if kind == "" {
			kind = "several promises at once"
		}
		groups[kind] = append(groups[kind], v)
	}
	var b strings.Builder
	b.WriteString(header)
	for _, kind := range slices.Sorted(maps.Keys(groups)) {
		fmt.Fprintf(&b, "  %d %s: %s\n", len(groups[kind]), what, kind)
	}
	for _, kind := range slices.Sorted(maps.Keys(groups)) {
		vs := groups[kind]
		fmt.Fprintf(&b, "\n== %s (%d %s; the first %d) ==\n", kind, len(vs), what, min(2, len(vs)))
		for _, v := range vs[:min(2, len(vs))] {
			b.WriteString(v.Timeline)
			if v.HTML != "" {
				fmt.Fprintf(&b, "   visualisation: %s\n", v.HTML)
			}
		}
	}
	return b.String()
}

// Require fails the test unless every count in min was reached in got: a run that did
// nothing must not pass.
func Require(t testing.TB, what string, got map[string]int, min map[string]int) {
	t.Helper()
	for _, k := range slices.Sorted(maps.Keys(min)) {
		if got[k] < min[k] {
			t.Errorf("the run did too little: %s %q happened %d times, want at least %d (all: %v)", what, k, got[k], min[k], got)
		}
	}
}
