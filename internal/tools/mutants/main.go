// Command mutants measures the history checker by the bugs it kills (`make mutants`). It copies
// the module's tree (the files git tracks or would track: ignored ones stay behind) to a
// scratch directory, never touching the working tree; applies each mutant of
// internal/history/mutants there in turn; builds the history tests' binaries from the mutated
// copy; runs the short mode of the history tests with each seed; and prints a kill table
// (Markdown): for each mutant and seed, which tests failed. A mutant whose test binary did not
// change is not run against that binary (it cannot tell it from the tree).
//
//	go run ./internal/tools/mutants [-seeds 1,2,3] [-only REGEXP] [-baseline] [-race] [-all]
//
// -baseline first runs the unmutated copy with the same seeds: every test must pass there,
// else a kill means nothing. -all runs every test binary of a seed even once one failed (by
// default the HTTP tests are skipped for a seed whose SQL and Go tests already killed it).
package main

import (
	"bytes"
	"crypto/sha256"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/pgidem/internal/history/mutants"
)

// suite is one test binary and the history tests it runs.
type suite struct {
	pkg, short, run string
}

var suites = []suite{
	{"./internal/history", "SQL+Do", "^(TestSQLHistory|TestDoHistory)$"},
	{"./cmd/server", "HTTP", "^(TestHTTPHistory|TestHTTPLiveness)$"},
}

type runResult struct {
	failed  []string // the tests that failed
	reasons []string // the first lines that say why
	skipped bool
	took    time.Duration
}

func main() {
	seedsFlag := flag.String("seeds", "1,2,3", "the seeds (HISTORY_SEED), comma-separated")
	only := flag.String("only", "", "run only the mutants whose name matches this regexp")
	baseline := flag.Bool("baseline", false, "first run the unmutated copy with the same seeds")
	race := flag.Bool("race", false, "build the test binaries with the race detector")
	all := flag.Bool("all", false, "run every test binary of a seed even once one failed")
	keep := flag.Bool("keep", false, "keep the scratch directory")
	out := flag.String("out", "", "also write the table to this file")
	check := flag.Bool("check", false, "only apply and build each mutant (no test runs)")
	flag.Parse()
	var seeds []string
	for _, s := range strings.Split(*seedsFlag, ",") {
		if _, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64); err != nil {
			fatalf("bad seed %q", s)
		}
		seeds = append(seeds, strings.TrimSpace(s))
	}
	match := regexp.MustCompile(*only)

	root, err := gitRoot()
	if err != nil {
		fatalf("%v", err)
	}
	scratch, err := os.MkdirTemp("", "pgidem-mutants-")
	if err != nil {
		fatalf("%v", err)
	}
	if !*keep {
		defer os.RemoveAll(scratch)
	}
	tree := filepath.Join(scratch, "tree")
	if err := copyTree(root, tree); err != nil {
		fatalf("copy: %v", err)
	}
	logf("scratch copy of %s in %s", root, tree)
	started := time.Now()

	bins := filepath.Join(scratch, "bin")
	_ = os.MkdirAll(bins, 0o755)
	build := func(tag string) ([]string, []string, error) {
		var paths, sums []string
		for i, s := range suites {
			path := filepath.Join(bins, fmt.Sprintf("%s-%d.test", tag, i))
			args := []string{"test", "-c", "-o", path}
			if *race {
				args = append(args, "-race")
			}
			cmd := exec.Command("go", append(args, s.pkg)...)
			cmd.Dir = tree
			if b, err := cmd.CombinedOutput(); err != nil {
				return nil, nil, fmt.Errorf("go test -c %s: %v\n%s", s.pkg, err, b)
			}
			sum, err := fileSum(path)
			if err != nil {
				return nil, nil, err
			}
			paths, sums = append(paths, path), append(sums, sum)
		}
		return paths, sums, nil
	}
	basePaths, baseSums, err := build("base")
	if err != nil {
		fatalf("the unmutated tree: %v", err)
	}

	type row struct {
		m       mutants.Mutant
		results []map[int]runResult // per seed, per suite
		note    string
		took    time.Duration
	}
	var rows []row
	runAll := func(paths []string, unchanged []bool, httpFirst, every bool) ([]map[int]runResult, bool) {
		var res []map[int]runResult
		killedEvery := true
		order := []int{0, 1}
		if httpFirst {
			order = []int{1, 0}
		}
		for _, seed := range seeds {
			per := map[int]runResult{}
			killed := false
			for _, i := range order {
				s := suites[i]
				switch {
				case unchanged != nil && unchanged[i]:
					per[i] = runResult{skipped: true}
					continue
				case killed && !every:
					per[i] = runResult{skipped: true}
					continue
				}
				r := runSuite(tree, paths[i], s, seed, filepath.Join(scratch, "artifacts"))
				per[i] = r
				killed = killed || len(r.failed) > 0
				logf("  seed %s %s: %s (%s)", seed, s.short, describe(r), r.took.Round(time.Second))
			}
			killedEvery = killedEvery && killed
			res = append(res, per)
		}
		return res, killedEvery
	}

	if *baseline {
		logf("baseline: the unmutated tree")
		t0 := time.Now()
		res, _ := runAll(basePaths, nil, false, true) // every test: each must pass
		rows = append(rows, row{m: mutants.Mutant{Name: "(none: the tree as it is)", Promise: "must pass"}, results: res,
			took: time.Since(t0)})
	}
	for _, m := range mutants.All {
		if !match.MatchString(m.Name) {
			continue
		}
		logf("mutant %s: %s", m.Name, m.Promise)
		t0 := time.Now()
		file := filepath.Join(tree, m.File)
		orig, err := os.ReadFile(file)
		if err != nil {
			fatalf("%v", err)
		}
		if n := bytes.Count(orig, []byte(m.Search)); n != 1 {
			rows = append(rows, row{m: m, note: fmt.Sprintf("not applied: its text occurs %d times", n)})
			continue
		}
		if err := os.WriteFile(file, bytes.Replace(orig, []byte(m.Search), []byte(m.Replace), 1), 0o644); err != nil {
			fatalf("%v", err)
		}
		paths, sums, err := build("mutant")
		switch {
		case err != nil:
			rows = append(rows, row{m: m, note: "does not build: " + firstLine(err.Error())})
		case *check:
			var changed []string
			for i, s := range suites {
				if sums[i] != baseSums[i] {
					changed = append(changed, s.short)
				}
			}
			logf("  builds; changes the test binaries of %v", changed)
		default:
			unchanged := make([]bool, len(suites))
			for i := range suites {
				unchanged[i] = sums[i] == baseSums[i]
			}
			// The tests meant to kill it first (the others run only with -all once it is killed).
			res, _ := runAll(paths, unchanged, strings.HasPrefix(m.Expected, "TestHTTP"), *all)
			rows = append(rows, row{m: m, results: res, took: time.Since(t0)})
		}
		if err := os.WriteFile(file, orig, 0o644); err != nil {
			fatalf("restore %s: %v", m.File, err)
		}
	}

	var b strings.Builder
	fmt.Fprintf(&b, "| mutant | breaks | %s | killed |\n|---|---|%s---|\n", strings.Join(prefix("seed ", seeds), " | "),
		strings.Repeat("---|", len(seeds)))
	killedAll, total := 0, 0
	for _, r := range rows {
		if r.note != "" {
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", r.m.Name, r.m.Promise, strings.Repeat("– | ", len(seeds)-1)+"–", r.note)
			continue
		}
		var cells []string
		runs := 0
		for _, per := range r.results {
			var by []string
			for i, s := range suites {
				if res := per[i]; len(res.failed) > 0 {
					by = append(by, s.short+": "+strings.Join(res.failed, ", "))
				}
			}
			baseline := strings.HasPrefix(r.m.Name, "(none")
			switch {
			case len(by) > 0 && baseline:
				runs++
				cells = append(cells, "**failed** ("+strings.Join(by, "; ")+")")
			case len(by) > 0:
				runs++
				cells = append(cells, "killed ("+strings.Join(by, "; ")+")")
			case baseline:
				cells = append(cells, "passed")
			default:
				cells = append(cells, "**survived**")
			}
		}
		verdict := fmt.Sprintf("%d of %d runs", runs, len(r.results))
		if strings.HasPrefix(r.m.Name, "(none") {
			verdict = fmt.Sprintf("%d of %d runs failed", runs, len(r.results))
		} else {
			total++
			if runs == len(r.results) {
				killedAll++
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s (%s) |\n", r.m.Name, r.m.Promise, strings.Join(cells, " | "), verdict,
			r.took.Round(time.Second))
	}
	fmt.Fprintf(&b, "\n%d of %d mutants killed in every run; %d seeds; %s in all (go test -c%s, one test binary at a time).\n",
		killedAll, total, len(seeds), time.Since(started).Round(time.Second), map[bool]string{true: " -race", false: ""}[*race])
	fmt.Print(b.String())
	if *out != "" {
		_ = os.MkdirAll(filepath.Dir(*out), 0o755)
		_ = os.WriteFile(*out, []byte(b.String()), 0o644)
	}
	// The reasons, for whoever reads the log.
	for _, r := range rows {
		for si, per := range r.results {
			for i, s := range suites {
				if res := per[i]; len(res.reasons) > 0 {
					fmt.Printf("%s, seed %s, %s: %s\n", r.m.Name, seeds[si], s.short, strings.Join(res.reasons, " | "))
				}
			}
		}
	}
}

// kindRe matches the lines of a failed history test that count violations by kind.
var kindRe = regexp.MustCompile(`^\s+\d+ (keys|clients): `)

// runSuite runs one test binary's history tests with a seed, from its package's directory.
func runSuite(tree, bin string, s suite, seed, artifacts string) runResult {
	t0 := time.Now()
	cmd := exec.Command(bin, "-test.run", s.run, "-test.count=1", "-test.v", "-test.timeout=15m")
	cmd.Dir = filepath.Join(tree, s.pkg)
	cmd.Env = append(os.Environ(), "HISTORY_SEED="+seed, "HISTORY_ARTIFACTS="+artifacts, "HISTORY_MODE=")
	var outb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &outb, &outb
	err := cmd.Run()
	r := runResult{took: time.Since(t0)}
	failRe := regexp.MustCompile(`^\s*--- FAIL: (Test\w+)`)
	for _, line := range strings.Split(outb.String(), "\n") {
		if m := failRe.FindStringSubmatch(line); m != nil && !slices.Contains(r.failed, m[1]) {
			r.failed = append(r.failed, m[1])
		}
		if t := strings.TrimSpace(line); (kindRe.MatchString(line) || strings.Contains(t, "did too little") ||
			strings.HasPrefix(t, "panic:")) && len(r.reasons) < 4 {
			r.reasons = append(r.reasons, short(t, 220))
		}
	}
	if err != nil && len(r.failed) == 0 {
		r.failed = []string{"(" + firstLine(err.Error()) + ")"}
	}
	return r
}

func describe(r runResult) string {
	if len(r.failed) == 0 {
		return "passed"
	}
	return "FAILED " + strings.Join(r.failed, ", ")
}

func prefix(p string, s []string) []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[i] = p + v
	}
	return out
}

func gitRoot() (string, error) {
	b, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		return "", fmt.Errorf("git rev-parse: %v", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// copyTree copies the files git tracks or would track (not the ignored ones) from root to dst.
func copyTree(root, dst string) error {
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	cmd.Dir = root
	b, err := cmd.Output()
	if err != nil {
		return err
	}
	for _, name := range strings.Split(strings.TrimRight(string(b), "\x00"), "\x00") {
		if name == "" {
			continue
		}
		src := filepath.Join(root, name)
		info, err := os.Lstat(src)
		if err != nil {
			if os.IsNotExist(err) {
				continue // deleted in the working tree
			}
			return err
		}
		if !info.Mode().IsRegular() {
			continue
		}
		target := filepath.Join(dst, name)
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		in, err := os.Open(src)
		if err != nil {
			return err
		}
		out, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, info.Mode().Perm())
		if err != nil {
			in.Close()
			return err
		}
		_, err = io.Copy(out, in)
		in.Close()
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func fileSum(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%x", sha256.Sum256(b)), nil
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return short(s, 160)
}

func short(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().UTC().Format("15:04:05")+" "+format+"\n", args...)
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "mutants: "+format+"\n", args...)
	os.Exit(1)
}
