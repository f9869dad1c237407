package history

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// Hand-made histories of one key, each with what the model must say of it: the checker is
// proven able to fail (every kind of violation is rejected) and able to pass (every allowed
// behaviour, unknown outcomes and faults included, is accepted).

const key = "alice/k1"

type opt func(*Input, *Output)

func lease(d time.Duration) opt { return func(in *Input, _ *Output) { in.Route, in.Lease = Leased, d } }
func pk(p string) opt           { return func(_ *Input, out *Output) { out.ProviderKey = p } }
func effect(e string) opt       { return func(_ *Input, out *Output) { out.Effect = e } }
func ttl(d time.Duration) opt   { return func(in *Input, _ *Output) { in.TTL = d } }
func stored(s float64) opt      { return func(_ *Input, out *Output) { out.StoredAfter = secs(s) } }

// op is client c sending request fp between call and ret (seconds), learning o (with body for
// an answer). An Unknown outcome returns at 100 s (the end of the history).
func op(c int, fp string, call, ret float64, o Outcome, body string, opts ...opt) porcupine.Operation {
	in := Input{Key: key, Client: c, Request: "send " + fp, Fingerprint: fp, TTL: 2 * time.Second,
		Call: secs(call)}
	out := Output{Outcome: o, Return: secs(ret)}
	if o == Answered || o == Replayed {
		out.Status, out.Body = 201, body
	}
	if o == Unknown {
		out.Return = secs(100)
	}
	for _, f := range opts {
		f(&in, &out)
	}
	return porcupine.Operation{ClientId: c, Input: in, Call: int64(in.Call), Output: out, Return: int64(out.Return)}
}

func observe(effects ...string) porcupine.Operation {
	in := Input{Key: key, Request: "observe", Call: secs(101)}
	return porcupine.Operation{Input: in, Call: int64(in.Call), Output: Output{Outcome: Observed, Effects: effects, Return: secs(101)},
		Return: int64(secs(101))}
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// live is the store's in_progress for this request, the lease live for d more.
func live(d time.Duration) opt {
	return func(_ *Input, out *Output) { out.Live, out.LiveFor, out.Note = true, d, "in_progress" }
}

// headers sets an answer's stored headers.
func headers(h string) opt { return func(_ *Input, out *Output) { out.Headers = h } }

func TestModelAccepts(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		ops  []porcupine.Operation
	}{
		{"in_progress while a lease runs, then a takeover after its end", []porcupine.Operation{
			op(1, "A", 0, 0.1, Held, "", lease(time.Second)),
			op(2, "A", 0.3, 0.35, Busy, "", lease(time.Second), live(600*time.Millisecond)),
			op(3, "A", 1.0, 1.1, Answered, "id 1", lease(time.Second), headers("Location: /1")),
			op(4, "A", 1.2, 1.3, Replayed, "id 1", lease(time.Second), headers("Location: /1")),
		}},
		{"an answer, its replays, a mismatch, 409s", []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1", effect("row 1")),
			op(2, "A", 0.05, 0.08, Busy, ""),
			op(2, "A", 0.2, 0.3, Replayed, "id 1", effect("row 1")),
			op(3, "B", 0.4, 0.5, Mismatch, ""),
			op(3, "B", 0.6, 0.7, Busy, ""), // a lock held by anything: refused, nothing changed
			observe("row 1"),
		}},
		{"a request that was never sent (no connection) changes nothing", []porcupine.Operation{
			op(1, "A", 0, 0.1, NotSent, "", lease(time.Second)),
			op(2, "B", 0.2, 0.3, Answered, "b", lease(time.Second)),
		}},
		{"a lost answer: the retry replays what the unknown attempt stored", []porcupine.Operation{
			op(1, "A", 0, 0.1, Unknown, ""),
			op(1, "A", 0.3, 0.4, Replayed, "id 7", effect("row 7")),
			op(2, "A", 0.5, 0.6, Replayed, "id 7", effect("row 7")),
			observe("row 7"),
		}},
		{"a failed attempt that did nothing, then the retry runs", []porcupine.Operation{
			op(1, "A", 0, 0.1, Failed, ""),
			op(1, "A", 0.2, 0.3, Answered, "id 2", effect("row 2")),
			observe("row 2"),
		}},
		{"a new generation after the TTL, with its own provider key", []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			op(2, "B", 2.2, 2.3, Answered, "po 2", lease(time.Second), pk("p2"), effect("payout 2")),
			op(2, "B", 2.4, 2.5, Replayed, "po 2", lease(time.Second), pk("p2"), effect("payout 2")),
			observe("payout 1", "payout 2"),
		}},
		{"a new generation just inside the clock slack", []porcupine.Operation{
			op(1, "A", 1, 1.2, Answered, "one"),
			op(2, "A", 2.96, 3.0, Answered, "two"),
		}},
		{"a lease that died (unknown), taken over by the same request after it ran out", []porcupine.Operation{
			op(1, "A", 0, 0.1, Unknown, "", lease(time.Second)),
			op(2, "A", 0.3, 0.4, Busy, "", lease(time.Second)),
			op(2, "A", 1.5, 1.9, Answered, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			op(3, "B", 2.0, 2.1, Mismatch, "", lease(time.Second)),
			observe("payout 1"),
		}},
		{"a held lease expires the TTL after its end, then another request claims", []porcupine.Operation{
			op(1, "A", 0, 0.05, Held, "", lease(time.Second), ttl(time.Second)),
			op(2, "B", 0.5, 0.6, Mismatch, "", ttl(time.Second)),
			op(2, "B", 2.1, 2.2, Answered, "b", ttl(time.Second)),
		}},
		{"a lease released, then another request at once", []porcupine.Operation{
			op(1, "A", 0, 0.1, Released, "", lease(time.Second), pk("p1")),
			op(2, "B", 0.2, 0.3, Answered, "b", lease(time.Second), pk("p2"), effect("payout 2")),
			observe("payout 2"), // the released attempt's payout may not exist
		}},
		{"an effect nobody saw named, from an attempt whose outcome is unknown", []porcupine.Operation{
			op(1, "A", 0, 0.1, Unknown, ""),
			observe("row 9"),
		}},
		{"a lease lost after the work: 409, and the takeover's answer", []porcupine.Operation{
			op(1, "A", 0, 1.5, Busy, "", lease(time.Second)),
			op(2, "A", 1.2, 1.4, Answered, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			op(3, "A", 1.6, 1.7, Replayed, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			observe("payout 1"),
		}},
		{"a lease claimed, seen held by another request, then released, then claimed again", []porcupine.Operation{
			op(1, "A", 0, 0.6, Failed, "", lease(time.Second)), // a 500: the handler failed, the claim released
			op(2, "B", 0.1, 0.12, Mismatch, "", lease(time.Second)),
			op(1, "A", 0.7, 0.8, Answered, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			observe("payout 1"),
		}},
		{"a lease route's 409 from the attempt whose store was acknowledged too late", []porcupine.Operation{
			// Its answer was stored, the acknowledgement lost, the retried store found the claim
			// completed (as if taken over): 409, and its retry gets the replay.
			op(1, "A", 0, 0.4, Busy, "", lease(time.Second)),
			op(2, "A", 0.01, 0.02, Busy, "", lease(time.Second)),
			op(1, "A", 0.5, 0.6, Replayed, "po 1", lease(time.Second), pk("p1"), effect("payout 1")),
			observe("payout 1"),
		}},
		{"a transactional claim takes over a dead lease; the answer is kept the TTL after it", []porcupine.Operation{
			op(1, "A", 0, 0.05, Held, "", lease(time.Second)),
			op(2, "A", 2.0, 2.05, Answered, "done"),
			op(3, "A", 3.5, 3.55, Replayed, "done"),
			op(3, "A", 4.2, 4.25, Answered, "again"), // 2.0 + 2 s: a new generation may start
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if res := porcupine.CheckOperations(Model(), tc.ops); !res {
				t.Fatalf("rejected:\n%s", Timeline(tc.ops, nil))
			}
		})
	}
}

func TestModelRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		breaks rule // the rule whose relaxation alone makes it legal
		ops    []porcupine.Operation
		why    string // in the timeline's explanation
	}{
		{"a replay without the stored headers", ruleAnswer, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1", headers("Location: /1")),
			op(2, "A", 0.2, 0.3, Replayed, "id 1"),
		}, "differs from the stored answer"},
		{"in_progress before any claim", ruleLive, []porcupine.Operation{
			op(1, "A", 0, 0.1, Busy, "", lease(time.Second), live(500*time.Millisecond)),
			op(2, "A", 0.2, 0.3, Answered, "id 1", lease(time.Second)),
		}, "no claim of it can be live"},
		{"a takeover before the end an in_progress gave", ruleTakeover, []porcupine.Operation{
			op(1, "A", 0, 0.1, Held, "", lease(time.Second)),
			op(2, "A", 0.5, 0.55, Busy, "", lease(time.Second), live(time.Second)),
			op(3, "A", 1.2, 1.3, Held, "", lease(time.Second)),
		}, "before it can have run out"},
		{"a replay that differs from the answer", ruleAnswer, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1"),
			op(2, "A", 0.2, 0.3, Replayed, "id 2"),
		}, "differs from the stored answer"},
		{"a second fresh answer within the TTL: the work ran twice", ruleTTL, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1"),
			op(2, "A", 0.5, 0.6, Answered, "id 1"),
		}, "cannot start before +2.000s"},
		{"a repeat without the replay marker", ruleTTL, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1"),
			op(2, "A", 0.5, 0.6, Answered, "id 1"),
		}, "a new generation cannot start"},
		{"another request answered within the TTL instead of 422", ruleTTL, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "a"),
			op(2, "B", 1.0, 1.1, Answered, "b"),
		}, "cannot start before"},
		{"a mismatch for a key nobody holds", ruleMismatch, []porcupine.Operation{
			op(1, "A", 0, 0.1, Mismatch, ""),
		}, "nothing holds the key"},
		{"a mismatch for the request that holds the key", ruleMismatch, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "a"),
			op(2, "A", 0.2, 0.3, Mismatch, ""),
		}, "the very request that holds the key"},
		{"a replay of a key never answered", ruleAnswer, []porcupine.Operation{
			op(1, "A", 0, 0.1, Replayed, "a"),
		}, "no answer is stored"},
		{"a replay after a release", ruleAnswer, []porcupine.Operation{
			op(1, "A", 0, 0.1, Released, "", lease(time.Second)),
			op(2, "A", 0.2, 0.3, Replayed, "a", lease(time.Second)),
		}, "no answer is stored"},
		{"the provider key of an earlier generation (after expiry)", rulePK, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "po 1 amount 100", lease(time.Second), pk("p1"), effect("payout 1")),
			op(2, "B", 2.5, 2.6, Answered, "po 1 amount 250000", lease(time.Second), pk("p1"), effect("payout 1")),
		}, "belongs to an earlier generation"},
		{"the provider key of a released generation", rulePK, []porcupine.Operation{
			op(1, "A", 0, 0.1, Released, "", lease(time.Second), pk("p1")),
			op(2, "B", 0.3, 0.4, Answered, "b", lease(time.Second), pk("p1")),
		}, "belongs to an earlier generation"},
		{"a new generation's answer, replayed, names the earlier one's provider key and payout", rulePK, []porcupine.Operation{
			// Not "a replay that is not the stored answer": that would explain any history away.
			op(1, "A", 0, 0.1, Answered, "po 1 for A", lease(time.Second), pk("p1"), effect("payout 1")),
			op(2, "B", 3.2, 3.3, Unknown, "", lease(time.Second)),
			op(2, "B", 3.4, 3.5, Replayed, "po 1 for B", lease(time.Second), pk("p1"), effect("payout 1")),
		}, "belongs to an earlier generation"},
		{"two provider keys in one generation", rulePK, []porcupine.Operation{
			op(1, "A", 0, 0.1, Held, "", lease(time.Second), pk("p1")),
			op(2, "A", 1.2, 1.3, Answered, "po", lease(time.Second), pk("p2")),
		}, "two provider keys"},
		{"an answer that names an earlier generation's effect", ruleEffects, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "po 1", lease(time.Second), effect("payout 1")),
			op(2, "B", 2.5, 2.6, Answered, "po 1 again", lease(time.Second), effect("payout 1")),
		}, "the effect of an earlier generation"},
		{"an answer whose effect does not exist", ruleEffects, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1", effect("row 1")),
			observe(),
		}, "does not exist afterwards"},
		{"two effects for one generation", ruleEffects, []porcupine.Operation{
			op(1, "A", 0, 0.1, Answered, "id 1", effect("row 1")),
			op(2, "A", 0.2, 0.3, Replayed, "id 1", effect("row 1")),
			observe("row 1", "row 2"),
		}, "more effects than generations"},
		{"a takeover before the lease can have run out", ruleTakeover, []porcupine.Operation{
			op(1, "A", 0, 0.05, Held, "", lease(time.Second)),
			op(2, "A", 0.2, 0.3, Answered, "po", lease(time.Second)),
		}, "before it can have run out"},
		{"another request claims during a held lease", ruleTTL, []porcupine.Operation{
			op(1, "A", 0, 0.05, Held, "", lease(time.Second)),
			op(2, "B", 2.0, 2.1, Answered, "b"),
		}, "cannot start before +3.000s"},
		{"a new generation before the TTL after the answer, the answer stored late in a slow takeover", ruleTTL, []porcupine.Operation{
			// From the takeover's call (2.0 s) the repeat would be legal; from when it sent
			// its answer (3.0 s) it is not.
			op(1, "A", 0, 0.05, Held, "", lease(time.Second)),
			op(2, "A", 2.0, 3.05, Answered, "done", stored(3.0)),
			op(3, "A", 4.6, 4.65, Answered, "again"),
		}, "cannot start before +5.000s"},
		{"the TTL counted from a dead lease, not from the answer", ruleTTL, []porcupine.Operation{
			// A lease that dies at 1 s; a transactional claim takes it over at 2.0 s and
			// answers; at 3.5 s (before 2.0 + 2 s) a repeat runs the work again.
			op(1, "A", 0, 0.05, Held, "", lease(time.Second)),
			op(2, "A", 2.0, 2.05, Answered, "done"),
			op(3, "A", 3.5, 3.55, Answered, "again"),
		}, "cannot start before +4.000s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if porcupine.CheckOperations(Model(), tc.ops) {
				t.Fatalf("accepted:\n%s", Timeline(tc.ops, nil))
			}
			tl := Timeline(tc.ops, nil)
			if !strings.Contains(tl, tc.why) {
				t.Fatalf("the timeline does not say %q:\n%s", tc.why, tl)
			}
			var want string
			for _, k := range ruleKinds {
				if k.r == tc.breaks {
					want = k.kind
				}
			}
			if causes := Causes(tc.ops, time.Minute); !slices.ContainsFunc(causes, func(c string) bool { return strings.Contains(c, want) }) {
				t.Fatalf("the violation is put down to %q, want %q:\n%s", causes, want, tl)
			}
		})
	}
}

// TestSharedProviderKey: a provider key reported under two keys is a violation no one key's
// history shows.
func TestSharedProviderKey(t *testing.T) {
	t.Parallel()
	h := New()
	for _, k := range []string{"alice/a", "bob/a"} {
		op := h.Begin(Input{Key: k, Client: h.Client(), Request: "pay 5", Fingerprint: "pay 5", Route: Leased, TTL: time.Minute, Lease: time.Second})
		op.End(Output{Outcome: Answered, Status: 201, Body: "po", ProviderKey: "pk-1"})
	}
	h.Close()
	res := Check(h, Options{Name: "TestSharedProviderKey", Dir: t.TempDir()})
	if len(res.Violations) != 1 || res.Violations[0].Kinds[0] != sharedKind || !strings.Contains(res.Violations[0].Timeline, "pk-1") {
		t.Fatalf("%+v", res.Violations)
	}
}

// TestCheckReports: Check finds the illegal key among legal ones, and writes its timeline and
// porcupine's visualisation where it says.
func TestCheckReports(t *testing.T) {
	t.Parallel()
	h := New()
	for _, k := range []string{"alice/ok", "alice/bad"} {
		a := h.Begin(Input{Key: k, Client: h.Client(), Request: "deposit 5", Fingerprint: "deposit 5", TTL: time.Minute})
		a.End(Output{Outcome: Answered, Status: 201, Body: `{"id":1}`, Effect: "row 1"})
		b := h.Begin(Input{Key: k, Client: h.Client(), Request: "deposit 5", Fingerprint: "deposit 5", TTL: time.Minute})
		body := `{"id":1}`
		if k == "alice/bad" {
			body = `{"id":2}`
		}
		b.End(Output{Outcome: Replayed, Status: 201, Body: body, Effect: "row 1"})
	}
	c := h.Begin(Input{Key: "alice/ok", Client: h.Client(), Request: "deposit 5", Fingerprint: "deposit 5", TTL: time.Minute})
	c.End(Output{Outcome: Unknown, Note: "hung up"})
	start := h.Now()
	h.Fault("cut", "reset_peer downstream", start)
	h.Close()
	h.Observe("alice/ok", []string{"row 1"})
	h.Observe("alice/bad", []string{"row 1"})
	dir := t.TempDir()
	res := Check(h, Options{Name: "TestCheckReports", Dir: dir})
	if res.Keys != 2 || len(res.Violations) != 1 || res.Violations[0].Key != "alice/bad" {
		t.Fatalf("%+v", res)
	}
	v := res.Violations[0]
	for _, want := range []string{"key alice/bad: NOT linearizable", "replayed 201 {\"id\":2}", "differs from the stored answer", " ✗ "} {
		if !strings.Contains(v.Timeline, want) {
			t.Errorf("the timeline lacks %q:\n%s", want, v.Timeline)
		}
	}
	if !strings.HasPrefix(res.Dir, dir) || v.HTML == "" {
		t.Fatalf("artifacts in %q, html %q", res.Dir, v.HTML)
	}
	html, err := os.ReadFile(v.HTML)
	if err != nil || !strings.Contains(string(html), "deposit 5") {
		t.Fatalf("visualisation: %v", err)
	}
	if _, err := os.Stat(filepath.Join(res.Dir, "violations.txt")); err != nil {
		t.Fatal(err)
	}
	outcomes, faults := h.Counts()
	if outcomes["2xx"] != 2 || outcomes["replayed"] != 2 || outcomes["unknown"] != 1 || faults["cut"] != 1 {
		t.Fatalf("counts %v %v", outcomes, faults)
	}
}
