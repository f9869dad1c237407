package idem_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryNameIsDocumented: what `go doc` and pkg.go.dev show of the public packages: a
// package overview with the wiring, and a doc comment on every exported name (a name in a
// documented const or var group counts as documented).
func TestEveryNameIsDocumented(t *testing.T) {
	for _, dir := range []string{".", "../idemclient"} {
		fset := token.NewFileSet()
		paths, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		byPkg := map[string][]*ast.File{}
		for _, path := range paths {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
			if err != nil {
				t.Fatal(err)
			}
			byPkg[f.Name.Name] = append(byPkg[f.Name.Name], f)
		}
		if len(byPkg) != 1 {
			t.Fatalf("%s: %d packages", dir, len(byPkg))
		}
		for name, files := range byPkg {
			pkg := struct{ Name string }{name}
			p, err := doc.NewFromFiles(fset, files, "github.com/pgidem/pgidem/"+pkg.Name)
			if err != nil {
				t.Fatal(err)
			}
			if len(p.Doc) < 500 || !strings.Contains(p.Doc, "New(") && pkg.Name == "idem" {
				t.Errorf("package %s: the overview is missing or has no wiring", pkg.Name)
			}
			undocumented := func(kind, name, text string) {
				if strings.TrimSpace(text) == "" {
					t.Errorf("package %s: %s %s has no doc comment", pkg.Name, kind, name)
				}
			}
			for _, f := range p.Funcs {
				undocumented("func", f.Name, f.Doc)
			}
			for _, v := range append(p.Consts, p.Vars...) {
				undocumented("const/var", strings.Join(v.Names, ", "), v.Doc)
			}
			for _, typ := range p.Types {
				undocumented("type", typ.Name, typ.Doc)
				for _, f := range append(typ.Funcs, typ.Methods...) {
					undocumented("func", f.Name, f.Doc)
				}
				for _, v := range append(typ.Consts, typ.Vars...) {
					undocumented("const/var", strings.Join(v.Names, ", "), v.Doc)
				}
			}
		}
	}
}
