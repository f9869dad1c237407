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
	// Chains is how many retrying clients (Session.Retry) the liveness check checked, Excused
	// how many of them it did not hold to the bound because a fault overlapped them, and
	// Liveness the ones that did not converge in time, each with its key's timeline.
	Chains, Excused int
	Liveness        []Violation
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
	res.Violations = append(res.Violations, fencedAnswers(parts, faults, o.Timeout)...)
	res.Violations = append(res.Violations, stepEffects(parts, h.Steps())...)
	slices.SortFunc(res.Violations, func(a, b Violation) int { return strings.Compare(a.Key, b.Key) })
	res.Chains, res.Excused, res.Liveness = checkLiveness(h, parts, faults, o.Timeout)
	all := o.All || os.Getenv("HISTORY_TIMELINES") == "all"
	if len(res.Violations) == 0 && len(res.Liveness) == 0 && !all {
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
	if len(res.Liveness) > 0 {
		var late strings.Builder
		for _, v := range res.Liveness {
			late.WriteString(v.Timeline)
			late.WriteString("\n")
		}
		_ = os.WriteFile(filepath.Join(res.Dir, "liveness.txt"), []byte(late.String()), 0o644)
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

// fencedKind is the kind of violation of an attempt that was told it lost its lease and yet
// is the answer.
const fencedKind = "the answer stored by an attempt that was told it lost its lease"

// fencedAnswers finds, per key, an answer (fresh or replayed) that names as its attempt one
// that was told its store was refused (Output.Fenced): such an attempt never becomes the
// answer, whatever the order. It needs no linearization: being told is final.
func fencedAnswers(parts [][]porcupine.Operation, faults []Fault, timeout time.Duration) []Violation {
	var out []Violation
	for _, p := range parts {
		fenced := map[int64]int{}
		for _, op := range p {
			if o := op.Output.(Output); o.Outcome == Lost && o.Fenced && o.Attempt != 0 {
				fenced[o.Attempt] = op.Input.(Input).Client
			}
		}
		if len(fenced) == 0 {
			continue
		}
		for _, op := range p {
			o := op.Output.(Output)
			c, ok := fenced[o.Attempt]
			if !ok || (o.Outcome != Answered && o.Outcome != Replayed) {
				continue
			}
			in := op.Input.(Input)
			timeline, _, _ := explain(p, faults, timeout)
			out = append(out, Violation{Key: in.Key, Kinds: []string{fencedKind}, Timeline: fmt.Sprintf(
				"key %s: NOT allowed: c%d at %s got the answer of attempt %d (%s), whose client c%d was told its store "+
					"was refused (it lost its lease)\n%s", in.Key, in.Client, at(int64(in.Call)), o.Attempt, o.Outcome, c, timeline)})
			break
		}
	}
	return out
}

// The kinds of violation of work in steps.
const (
	stepTwiceKind  = "a step's effect twice in one generation"
	stepAnswerKind = "an answer before its steps, or naming a step effect that is not there"
)

// stepEffects checks work in steps, beside the model (a step's row names its generation by its
// provider key, so no linearization is needed): every step's effect at most once per
// generation, and every answer (fresh or replayed) that names step effects names rows that
// exist, in its own generation: the answer comes only after the last step committed.
func stepEffects(parts [][]porcupine.Operation, steps map[string][]StepEffect) []Violation {
	var out []Violation
	for _, key := range slices.Sorted(maps.Keys(steps)) {
		seen := map[[2]string][]string{}
		for _, e := range steps[key] {
			seen[[2]string{e.ProviderKey, e.Step}] = append(seen[[2]string{e.ProviderKey, e.Step}], e.ID)
		}
		for _, gs := range slices.SortedFunc(maps.Keys(seen), func(a, b [2]string) int { return strings.Compare(a[0]+a[1], b[0]+b[1]) }) {
			if ids := seen[gs]; len(ids) > 1 {
				out = append(out, Violation{Key: key, Kinds: []string{stepTwiceKind}, Timeline: fmt.Sprintf(
					"key %s: NOT allowed: step %s of generation %s wrote %d rows (%s)\n", key, gs[1], gs[0], len(ids), strings.Join(ids, ", "))})
			}
		}
	}
	for _, p := range parts {
		key := p[0].Input.(Input).Key
		rows := map[StepEffect]bool{}
		for _, e := range steps[key] {
			rows[e] = true
		}
		for _, op := range p {
			o := op.Output.(Output)
			if o.Steps == "" || (o.Outcome != Answered && o.Outcome != Replayed) {
				continue
			}
			for _, named := range strings.Split(o.Steps, ",") {
				step, id, _ := strings.Cut(named, "=")
				if !rows[StepEffect{ProviderKey: o.ProviderKey, Step: step, ID: id}] {
					in := op.Input.(Input)
					out = append(out, Violation{Key: key, Kinds: []string{stepAnswerKind}, Timeline: fmt.Sprintf(
						"key %s: NOT allowed: c%d at %s got an answer (%s) naming step %s row %s of generation %s, which is not there\n",
						key, in.Client, at(int64(in.Call)), o.Outcome, step, id, o.ProviderKey)})
				}
			}
		}
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
