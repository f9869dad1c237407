package history

import (
	"strings"
	"testing"
	"time"
)

// livenessHistory is a closed history of one key: the operations given, and chains.
func livenessHistory(ops []Op, chains []Chain, faults []Fault) *History {
	h := New()
	for i := range ops {
		op := ops[i]
		op.h, op.ended = h, true
		h.ops = append(h.ops, &op)
	}
	for i := range chains {
		h.chains = append(h.chains, &chains[i])
	}
	h.faults = faults
	h.closed, h.end = true, secs(100)
	for _, op := range h.ops {
		if op.out.Outcome == Unknown {
			op.out.Return = h.end
		}
	}
	return h
}

func sent(c int, call, ret float64, o Outcome, body string) Op {
	in := Input{Key: key, Client: c, Request: "send a", Fingerprint: "a", TTL: time.Minute, Lease: 10 * time.Second, Call: secs(call)}
	out := Output{Outcome: o, Return: secs(ret), Status: 201, Body: body}
	switch o {
	case Unknown:
		out.Status, out.Body, out.GaveUp = 0, "", secs(ret)
	case Busy:
		out.Status, out.Body = 409, ""
	}
	return Op{in: in, out: out}
}

func chain(c int, start, end float64, last Op, done bool) Chain {
	in := last.in
	in.Client, in.Call = c, secs(start)
	return Chain{In: in, Start: secs(start), End: secs(end), Attempts: 2, Last: last.out, Done: done}
}

// TestLiveness: a duplicate that gets the answer within the bound after it was stored passes;
// one that gets it later, or gives up, is reported; a fault excuses; a chain the run cut is not
// checked.
func TestLiveness(t *testing.T) {
	first := sent(1, 0, 2, Answered, "x")
	for _, tc := range []struct {
		name           string
		ops            []Op
		chains         []Chain
		faults         []Fault
		want           string // the kind, "" for none
		checked, excus int
	}{
		{name: "in time", ops: []Op{first, sent(2, 0.2, 0.25, Busy, ""), sent(2, 2.6, 2.7, Replayed, "x")},
			chains: []Chain{chain(2, 0.2, 2.7, sent(2, 2.6, 2.7, Replayed, "x"), true)}, checked: 1},
		{name: "late", ops: []Op{first, sent(2, 0.2, 0.25, Busy, ""), sent(2, 10.2, 10.3, Replayed, "x")},
			chains: []Chain{chain(2, 0.2, 10.3, sent(2, 10.2, 10.3, Replayed, "x"), true)}, want: kindLate, checked: 1},
		{name: "gave up after the answer", ops: []Op{first, sent(2, 0.2, 0.25, Busy, "")},
			chains: []Chain{chain(2, 0.2, 5, sent(2, 0.2, 0.25, Busy, ""), false)}, want: kindLate, checked: 1},
		{name: "gave up, nothing stored", ops: []Op{sent(1, 0, 1, Unknown, ""), sent(1, 1.1, 2.1, Unknown, "")},
			chains: []Chain{chain(1, 0, 6, sent(1, 1.1, 2.1, Unknown, ""), false)}, want: kindGaveUp, checked: 1},
		{name: "a fault excuses", ops: []Op{first, sent(2, 0.2, 0.25, Busy, ""), sent(2, 10.2, 10.3, Replayed, "x")},
			chains: []Chain{chain(2, 0.2, 10.3, sent(2, 10.2, 10.3, Replayed, "x"), true)},
			faults: []Fault{{Kind: "stall", From: secs(3), To: secs(4)}}, checked: 1, excus: 1},
		{name: "cut", ops: []Op{sent(1, 0, 1, Unknown, "")},
			chains: []Chain{func() Chain { c := chain(1, 0, 1, sent(1, 0, 1, Unknown, ""), false); c.Cut = true; return c }()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := livenessHistory(tc.ops, tc.chains, tc.faults)
			res := Check(h, Options{Name: t.Name(), Dir: t.TempDir()})
			if len(res.Violations) > 0 {
				t.Fatalf("safety: %v", res.Violations[0].Timeline)
			}
			if res.Chains != tc.checked || res.Excused != tc.excus {
				t.Errorf("checked %d, excused %d; want %d, %d", res.Chains, res.Excused, tc.checked, tc.excus)
			}
			switch {
			case tc.want == "" && len(res.Liveness) > 0:
				t.Errorf("reported: %s", res.Liveness[0].Timeline)
			case tc.want != "" && (len(res.Liveness) != 1 || res.Liveness[0].Kinds[0] != tc.want):
				t.Errorf("want one %q, got %+v", tc.want, res.Liveness)
			case tc.want != "" && !strings.Contains(res.Liveness[0].Timeline, "chain: c"):
				t.Errorf("no chain line: %s", res.Liveness[0].Timeline)
			}
			if len(res.Liveness) > 0 {
				t.Log(res.Liveness[0].Timeline)
			}
		})
	}
}
