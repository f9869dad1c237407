package history

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// History records the operations of concurrent clients, and the faults injected meanwhile.
// It is safe for concurrent use. Times are measured from New on the monotonic clock.
type History struct {
	start time.Time

	mu       sync.Mutex
	ops      []*Op
	faults   []Fault
	clients  int
	closed   bool
	end      time.Duration
	observed map[string][]string
	steps    map[string][]StepEffect
	chains   []*Chain
	stored   []storeSeen
}

// Op is one operation in flight or done: Begin records its call, End its return.
type Op struct {
	h     *History
	in    Input
	out   Output
	ended bool
}

// Fault is a fault injected while the history ran: a kind ("cut", "server-kill"...), a
// detail, and when it began and ended.
type Fault struct {
	Kind, Detail string
	From, To     time.Duration
}

// New starts a history now.
func New() *History {
	return &History{start: time.Now(), observed: map[string][]string{}, steps: map[string][]StepEffect{}}
}

// Now is the time since the history began.
func (h *History) Now() time.Duration { return time.Since(h.start) }

// Client returns a new client number.
func (h *History) Client() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.clients++
	return h.clients
}

// Begin records the call of an operation now (in.Call is set) and returns it.
func (h *History) Begin(in Input) *Op {
	in.Call = h.Now()
	op := &Op{h: h, in: in}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		panic("history: Begin after Close")
	}
	h.ops = append(h.ops, op)
	return op
}

// End records what the operation learned, now, and returns it as recorded (Return set). An
// Unknown outcome records when the client gave up (GaveUp); the operation's return is the end
// of the history (Close), since it may still take effect.
func (op *Op) End(out Output) Output {
	now := op.h.Now()
	op.h.mu.Lock()
	defer op.h.mu.Unlock()
	if op.ended {
		panic("history: End twice")
	}
	op.ended = true
	if !out.StoreSent.IsZero() {
		out.StoredAfter = out.StoreSent.Sub(op.h.start)
	}
	if out.Outcome == Unknown {
		out.GaveUp = now
	} else {
		out.Return = now
	}
	op.out = out
	if out.Outcome == Unknown {
		out.Return = now // for the client: when it stopped waiting
	}
	return out
}

// Input is what the operation sent.
func (op *Op) Input() Input { return op.in }

// Fault records a fault that began at from and ended now, and returns its record.
func (h *History) Fault(kind, detail string, from time.Duration) Fault {
	f := Fault{Kind: kind, Detail: detail, From: from, To: h.Now()}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.faults = append(h.faults, f)
	return f
}

// Close ends the history: every operation not ended, or ended Unknown, returns now. Call it
// once every client has stopped and the system has settled (leases ended, rolled-back
// connections gone), before Observe.
func (h *History) Close() {
	now := h.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed, h.end = true, now
	for _, op := range h.ops {
		if !op.ended {
			op.ended, op.out = true, Output{Outcome: Unknown, Note: "never returned", GaveUp: now}
		}
		if op.out.Outcome == Unknown {
			op.out.Return = now
		}
	}
}

// Observe records the effects found under key once the history was closed.
func (h *History) Observe(key string, effects []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.closed {
		panic("history: Observe before Close")
	}
	h.observed[key] = slices.Sorted(slices.Values(effects))
}

// StepEffect is one row that a step of stepped work wrote (work in steps, idem.Step): which
// generation (its provider key), which step, the row's id.
type StepEffect struct {
	ProviderKey, Step, ID string
}

// ObserveSteps records the step effects found under key once the history was closed.
func (h *History) ObserveSteps(key string, effects []StepEffect) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.closed {
		panic("history: ObserveSteps before Close")
	}
	h.steps[key] = slices.Clone(effects)
}

// Steps returns the step effects observed, by key.
func (h *History) Steps() map[string][]StepEffect {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps.Clone(h.steps)
}

// Keys lists the keys of the history's operations, sorted.
func (h *History) Keys() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	keys := map[string]bool{}
	for _, op := range h.ops {
		keys[op.in.Key] = true
	}
	return slices.Sorted(maps.Keys(keys))
}

// Operations returns the history for porcupine: one operation per call, and per observed key
// a last one with the effects found.
func (h *History) Operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]porcupine.Operation, 0, len(h.ops)+len(h.observed))
	for _, op := range h.ops {
		out = append(out, porcupine.Operation{ClientId: op.in.Client, Input: op.in, Call: int64(op.in.Call),
			Output: op.out, Return: int64(op.out.Return)})
	}
	at := h.end + time.Millisecond
	for _, key := range slices.Sorted(maps.Keys(h.observed)) {
		out = append(out, porcupine.Operation{ClientId: 0, Input: Input{Key: key, Request: "observe effects", Call: at},
			Call: int64(at), Output: Output{Outcome: Observed, Effects: h.observed[key], Return: at}, Return: int64(at)})
	}
	return out
}

// Faults returns the faults injected.
func (h *History) Faults() []Fault {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.faults)
}

// Label is the outcome class of an operation for counts: "2xx", "final 422", "replay",
// "mismatch", "busy", "503", "error", "unknown", "held", "released", "lost".
func Label(out Output) string {
	switch out.Outcome {
	case Answered:
		if out.Status/100 == 2 {
			return "2xx"
		}
		return fmt.Sprintf("final %d", out.Status)
	case Failed:
		if out.Status != 0 {
			return fmt.Sprint(out.Status)
		}
		return "error"
	case NotSent:
		return "not sent"
	}
	return out.Outcome.String()
}

// Counts returns how many operations had each label (Label), and how many faults of each
// kind were injected.
func (h *History) Counts() (outcomes, faults map[string]int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	outcomes, faults = map[string]int{}, map[string]int{}
	for _, op := range h.ops {
		if op.ended {
			outcomes[Label(op.out)]++
		} else {
			outcomes["unknown"]++
		}
	}
	for _, f := range h.faults {
		faults[f.Kind]++
	}
	return outcomes, faults
}

// Len is the number of operations recorded.
func (h *History) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ops)
}

// Summary is the counts as one line each: "outcomes: 2xx 310, replay 41, ..." and
// "faults: cut 12, ...".
func Summary(outcomes, faults map[string]int) string {
	line := func(m map[string]int) string {
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(m)) {
			parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
		}
		return strings.Join(parts, ", ")
	}
	total := 0
	for _, n := range outcomes {
		total += n
	}
	return fmt.Sprintf("%d operations; outcomes: %s; faults: %s", total, line(outcomes), line(faults))
}
