package history

import (
	"slices"
	"testing"
	"time"
)

// TestStepEffects: the checks of work in steps find a step's effect written twice in one
// generation and an answer that names a step row that is not there (an answer stored before
// its last step, or a row of another generation), and pass a history where each step wrote
// once and the answers name those rows.
func TestStepEffects(t *testing.T) {
	run := func(answer string, rows []StepEffect) []string {
		h := New()
		in := Input{Key: "alice/k1", Client: 1, Request: "job", Fingerprint: "f", Route: Leased, TTL: time.Second, Lease: time.Second}
		h.Begin(in).End(Output{Outcome: Answered, Status: 200, ProviderKey: "pk1", Steps: answer})
		in.Client = 2
		h.Begin(in).End(Output{Outcome: Replayed, Status: 200, ProviderKey: "pk1", Steps: answer})
		h.Close()
		h.ObserveSteps("alice/k1", rows)
		var kinds []string
		for _, v := range stepEffects(partition(h.Operations()), h.Steps()) {
			kinds = append(kinds, v.Kinds...)
		}
		return slices.Compact(kinds)
	}
	good := []StepEffect{{"pk1", "a", "1"}, {"pk1", "b", "2"}, {"pk0", "a", "7"}} // pk0: an earlier generation
	if k := run("a=1,b=2", good); len(k) != 0 {
		t.Fatalf("a clean history: %v", k)
	}
	if k := run("a=1,b=2", append(slices.Clone(good), StepEffect{"pk1", "a", "3"})); !slices.Equal(k, []string{stepTwiceKind}) {
		t.Fatalf("step a twice in one generation: %v, want %q", k, stepTwiceKind)
	}
	if k := run("a=1,b=2", good[:1]); !slices.Equal(k, []string{stepAnswerKind}) {
		t.Fatalf("an answer without its last step: %v, want %q", k, stepAnswerKind)
	}
	if k := run("a=7,b=2", good); !slices.Equal(k, []string{stepAnswerKind}) {
		t.Fatalf("an answer naming another generation's row: %v, want %q", k, stepAnswerKind)
	}
}
