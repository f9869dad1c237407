// Command vulndb is `make vuln`: a vulnerability scan that needs only the Go module proxy, not
// vuln.go.dev. It turns the OSV entries of a snapshot of the Go vulnerability database (the
// data/osv folder of the module golang.org/x/vulndb, pinned in the Makefile) into the folder
// layout that govulncheck reads with -db file://... (index/db.json, index/modules.json,
// index/vulns.json and ID/<id>.json), runs govulncheck over the module with it, prints each
// vulnerability the code calls, and fails when one is in a module (a dependency to upgrade).
// One in the standard library is reported, not failed on: it is the Go toolchain's, the
// machine's (upgrade Go where the server is built).
//
// golang.org/x/vulndb has its own command for this (cmd/indexdb), but building it downloads and
// compiles that module's whole dependency tree (Google Cloud clients among them), about five
// minutes on a fresh machine; the layout it writes is this small (docs/DECISIONS.md).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// entry is what the index needs of an OSV entry; the entry itself is copied as it is.
type entry struct {
	ID       string   `json:"id"`
	Modified string   `json:"modified"`
	Aliases  []string `json:"aliases,omitempty"`
	Affected []struct {
		Package struct {
			Name string `json:"name"`
		} `json:"package"`
	} `json:"affected"`
}

type vulnRef struct {
	ID       string `json:"id"`
	Modified string `json:"modified"`
}

type module struct {
	Path  string    `json:"path"`
	Vulns []vulnRef `json:"vulns"`
}

type vuln struct {
	ID       string   `json:"id"`
	Modified string   `json:"modified"`
	Aliases  []string `json:"aliases,omitempty"`
}

func main() {
	osv := flag.String("osv", "", "the folder of OSV JSON files (golang.org/x/vulndb's data/osv)")
	flag.Parse()
	if *osv == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: vulndb -osv DIR PACKAGES...")
		os.Exit(2)
	}
	out, err := os.MkdirTemp("", "idem-vulndb-")
	if err == nil {
		defer os.RemoveAll(out)
		err = run(*osv, out)
	}
	if err == nil {
		err = scan(out, flag.Args())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "vulndb:", err)
		os.Exit(1)
	}
}

// finding is what the scan needs of a govulncheck finding (its JSON output).
type finding struct {
	OSV          string `json:"osv"`
	FixedVersion string `json:"fixed_version"`
	Trace        []struct {
		Module   string `json:"module"`
		Version  string `json:"version"`
		Package  string `json:"package"`
		Function string `json:"function"`
	} `json:"trace"`
}

// scan runs govulncheck over pkgs with the database in db and reports the vulnerabilities the
// code calls (a finding whose trace reaches a function); it fails on those in modules.
func scan(db string, pkgs []string) error {
	cmd := exec.Command("go", append([]string{"tool", "govulncheck", "-db", "file://" + db, "-format", "json"}, pkgs...)...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	called := map[string]finding{} // osv id -> the first called finding
	dec := json.NewDecoder(stdout)
	for {
		var msg struct {
			Finding *finding `json:"finding"`
		}
		if err := dec.Decode(&msg); err != nil {
			if err == io.EOF {
				break
			}
			return fmt.Errorf("govulncheck's output: %w", err)
		}
		if f := msg.Finding; f != nil && len(f.Trace) > 0 && f.Trace[0].Function != "" {
			if _, ok := called[f.OSV]; !ok {
				called[f.OSV] = *f
			}
		}
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("govulncheck: %w", err)
	}
	var ids []string
	for id := range called {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var inModules []string
	for _, id := range ids {
		f := called[id]
		at := f.Trace[0]
		where := at.Module + "@" + at.Version
		if at.Module == "stdlib" {
			where = "the standard library (Go " + strings.TrimPrefix(at.Version, "v") + "): " + at.Package
		} else {
			inModules = append(inModules, id)
		}
		fmt.Printf("%s in %s, fixed in %s\n", id, where, f.FixedVersion)
	}
	fmt.Printf("vulndb: %d vulnerabilities the code calls, %d of them in modules\n", len(ids), len(inModules))
	if len(inModules) > 0 {
		return fmt.Errorf("upgrade the modules of %s", strings.Join(inModules, ", "))
	}
	return nil
}

func run(osv, out string) error {
	paths, err := filepath.Glob(filepath.Join(osv, "*.json"))
	if err != nil {
		return err
	}
	if len(paths) == 0 {
		return fmt.Errorf("no OSV entries in %s", osv)
	}
	for _, dir := range []string{"index", "ID"} {
		if err := os.MkdirAll(filepath.Join(out, dir), 0o755); err != nil {
			return err
		}
	}
	modules := map[string][]vulnRef{}
	var vulns []vuln
	latest := ""
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		var e entry
		if err := json.Unmarshal(b, &e); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if e.ID == "" || strings.ContainsAny(e.ID, `/\`) {
			return fmt.Errorf("%s: no usable id", p)
		}
		if err := os.WriteFile(filepath.Join(out, "ID", e.ID+".json"), b, 0o644); err != nil {
			return err
		}
		vulns = append(vulns, vuln{ID: e.ID, Modified: e.Modified, Aliases: e.Aliases})
		seen := map[string]bool{}
		for _, a := range e.Affected {
			if name := a.Package.Name; name != "" && !seen[name] {
				seen[name] = true
				modules[name] = append(modules[name], vulnRef{ID: e.ID, Modified: e.Modified})
			}
		}
		latest = max(latest, e.Modified)
	}
	var mods []module
	for path, refs := range modules {
		mods = append(mods, module{Path: path, Vulns: refs})
	}
	sort.Slice(mods, func(i, j int) bool { return mods[i].Path < mods[j].Path })
	sort.Slice(vulns, func(i, j int) bool { return vulns[i].ID < vulns[j].ID })
	for name, v := range map[string]any{"db.json": map[string]string{"modified": latest}, "modules.json": mods, "vulns.json": vulns} {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(out, "index", name), b, 0o644); err != nil {
			return err
		}
	}
	fmt.Printf("vulndb: %d entries, %d modules\n", len(vulns), len(mods))
	return nil
}
