package history

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Result is what Check found.
type Result struct {
	// Keys and Operations are how much was checked.
	Keys, Operations int
	// Violations are the keys that no linearization explains, with their timelines.
	Violations []Violation
	// Inconclusive lists the keys porcupine could not decide within the timeout.
	Inconclusive []string
	// Dir is where the artifacts were written ("" when there was nothing to write).
	Dir string
	// Took is how long the check took, explanations included; Slowest is the key whose
	// check took longest, and how long.
	Took        time.Duration
	Slowest     string
	SlowestTook time.Duration
}

// Violation is one key whose history the model does not allow.
type Violation struct {
	// Key is the partition.
	Key string
	// Kinds are the promises it breaks (Causes); empty when no one or two rules explain it.
	Kinds []string
	// Timeline is the key's history, one line per operation, with the generations the
	// longest linearization placed them in and why the others fit nowhere.
	Timeline string
	// HTML is the path of porcupine's visualisation of the key's history ("" when not written).
	HTML string
}

// Options configure Check.
type Options struct {
	// Name names the run's artifact directory (a test's name).
	Name string
	// Dir is where artifacts go; "" means ArtifactsDir().
	Dir string
	// Timeout bounds porcupine's search per key. 0: 30 seconds.
	Timeout time.Duration
	// MaxHTML bounds how many visualisations are written. 0: 20.
	MaxHTML int
	// All writes every key's timeline (all-timelines.txt), legal or not, when the run has a
	// violation or All is set. Default: $HISTORY_TIMELINES=all.
	All bool
}

// ArtifactsDir is where Check writes timelines and visualisations by default: $HISTORY_ARTIFACTS
// when set, else .artifacts/history at the root of the module (found from the working
// directory upward; git ignores it), else the temporary directory.
func ArtifactsDir() string {
	if d := os.Getenv("HISTORY_ARTIFACTS"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	for err == nil {
		if _, e := os.Stat(filepath.Join(dir, "go.mod")); e == nil {
			return filepath.Join(dir, ".artifacts", "history")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	return filepath.Join(os.TempDir(), "pgidem-history")
}

// Check closes nothing: call h.Close and h.Observe first. It checks each key's history
// against the model with porcupine, in parallel, and for every key it finds illegal writes the
// timeline and porcupine's HTML visualisation (with the faults as annotations) under
// Options.Dir/<Name>-<time>/.
func Check(h *History, o Options) (res Result) {
	if o.Timeout == 0 {
		o.Timeout = 30 * time.Second
	}
	if o.MaxHTML == 0 {
		o.MaxHTML = 20
	}
	started := time.Now()
	model := Model()
	parts := partition(h.Operations())
	res = Result{Keys: len(parts)}
	defer func() { res.Took = time.Since(started) }()
	type verdict struct {
		ops      []porcupine.Operation
		result   porcupine.CheckResult
		took     time.Duration
		timeline string
		kinds    []string
	}
	faults := h.Faults()
	verdicts := make([]verdict, len(parts))
	var wg sync.WaitGroup
	work := make(chan int)
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				began := time.Now()
				v := verdict{ops: parts[i], result: porcupine.CheckOperationsTimeout(model, parts[i], o.Timeout)}
				v.took = time.Since(began)
				if v.result == porcupine.Illegal {
					v.timeline, v.kinds, _ = explain(parts[i], faults, o.Timeout)
				}
				verdicts[i] = v
			}
		}()
	}
	for i := range parts {
		res.Operations += len(parts[i])
		work <- i
	}
	close(work)
	wg.Wait()
	for _, v := range verdicts {
		key := v.ops[0].Input.(Input).Key
		if v.took > res.SlowestTook {
			res.Slowest, res.SlowestTook = key, v.took
		}
		switch v.result {
		case porcupine.Illegal:
			res.Violations = append(res.Violations, Violation{Key: key, Kinds: v.kinds, Timeline: v.timeline})
		case porcupine.Unknown:
			res.Inconclusive = append(res.Inconclusive, key)
		}
	}
	res.Violations = append(res.Violations, sharedProviderKeys(parts)...)
	slices.SortFunc(res.Violations, func(a, b Violation) int { return strings.Compare(a.Key, b.Key) })
	all := o.All || os.Getenv("HISTORY_TIMELINES") == "all"
	if len(res.Violations) == 0 && !all {
		return res
	}
	name := strings.NewReplacer("/", "_", " ", "_").Replace(o.Name)
	res.Dir = filepath.Join(firstNonEmpty(o.Dir, ArtifactsDir()), fmt.Sprintf("%s-%s", name, time.Now().Format("20060102-150405")))
	if err := os.MkdirAll(res.Dir, 0o755); err != nil {
		res.Dir = ""
		return res
	}
	var illegal strings.Builder
	for i := range res.Violations {
		v := &res.Violations[i]
		illegal.WriteString(v.Timeline)
		illegal.WriteString("\n")
		if i >= o.MaxHTML {
			continue
		}
		var ops []porcupine.Operation
		for _, p := range parts {
			if p[0].Input.(Input).Key == v.Key {
				ops = p
			}
		}
		path := filepath.Join(res.Dir, fmt.Sprintf("%03d-%s.html", i+1, fileName(v.Key)))
		if err := visualize(model, ops, faults, path, o.Timeout); err == nil {
			v.HTML = path
		}
	}
	if len(res.Violations) > 0 {
		_ = os.WriteFile(filepath.Join(res.Dir, "violations.txt"), []byte(illegal.String()), 0o644)
	}
	var every strings.Builder
	for _, p := range parts {
		timeline, _, _ := explain(p, faults, o.Timeout)
		every.WriteString(timeline)
		every.WriteString("\n")
	}
	_ = os.WriteFile(filepath.Join(res.Dir, "all-timelines.txt"), []byte(every.String()), 0o644)
	return res
}

// sharedKind is the kind of violation that no one key's history shows.
const sharedKind = "a provider key shared by two keys"

// sharedProviderKeys finds provider keys that answers under two different keys reported: a
// provider key belongs to one generation of one key of one principal. It is the one promise
// that crosses partitions, so it is checked here rather than by the model.
func sharedProviderKeys(parts [][]porcupine.Operation) []Violation {
	owners := map[string]map[string]bool{}
	for _, p := range parts {
		for _, op := range p {
			if pk := op.Output.(Output).ProviderKey; pk != "" {
				if owners[pk] == nil {
					owners[pk] = map[string]bool{}
				}
				owners[pk][op.Input.(Input).Key] = true
			}
		}
	}
	var out []Violation
	for _, pk := range slices.Sorted(maps.Keys(owners)) {
		if len(owners[pk]) < 2 {
			continue
		}
		keys := slices.Sorted(maps.Keys(owners[pk]))
		out = append(out, Violation{Key: strings.Join(keys, " + "), Kinds: []string{sharedKind},
			Timeline: fmt.Sprintf("keys %s: NOT allowed: each reported provider key %s\n", strings.Join(keys, ", "), pk)})
	}
	return out
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func fileName(key string) string {
	return strings.Map(func(r rune) rune {
		if r == '-' || r == '_' || r == '.' || ('a' <= r && r <= 'z') || ('A' <= r && r <= 'Z') || ('0' <= r && r <= '9') {
			return r
		}
		return '_'
	}, key)
}

// visualize writes porcupine's visualisation of one key's history, client numbers made
// dense (one row per client), the faults as annotations.
func visualize(model porcupine.Model, ops []porcupine.Operation, faults []Fault, path string, timeout time.Duration) error {
	rows := map[int]int{}
	dense := make([]porcupine.Operation, len(ops))
	for i, op := range ops {
		if _, ok := rows[op.ClientId]; !ok {
			rows[op.ClientId] = len(rows)
		}
		op.ClientId = rows[op.ClientId]
		dense[i] = op
	}
	_, info := porcupine.CheckOperationsVerbose(model, dense, timeout)
	from, to := window(ops)
	var notes []porcupine.Annotation
	for _, f := range faults {
		if int64(f.To) >= from && int64(f.From) <= to {
			notes = append(notes, porcupine.Annotation{Tag: "faults", Start: int64(f.From), End: int64(f.To),
				Description: f.Kind, Details: f.Detail, BackgroundColor: "#f4cccc"})
		}
	}
	info.AddAnnotations(notes)
	return porcupine.VisualizePath(model, info, path)
}

// window is the time the key's client operations span: from the first call to the last
// return (an unknown outcome counts until the client gave up).
func window(ops []porcupine.Operation) (from, to int64) {
	from, to = -1, 0
	for _, op := range ops {
		out := op.Output.(Output)
		if out.Outcome == Observed {
			continue
		}
		ret := op.Return
		if out.Outcome == Unknown {
			ret = int64(out.GaveUp)
		}
		if from < 0 || op.Call < from {
			from = op.Call
		}
		to = max(to, ret)
	}
	return from, to
}

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
