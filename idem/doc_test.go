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

// publicDirs are the public packages of the module: what `go doc` and pkg.go.dev show.
var publicDirs = []string{".", "../idemclient", "idemprom", "idemmux", "idemmigrate", "idemtest", "idemriver"}

// TestEveryNameIsDocumented: what `go doc -all` shows of the public packages: a package
// overview (with the wiring, for idem), types of their own (no alias of an internal type,
// whose fields and methods `go doc` would not show), and a doc comment on every exported name,
// every exported field of a struct and every method of an interface (a name in a documented
// const or var group, or a field in a documented group of fields, counts as documented).
func TestEveryNameIsDocumented(t *testing.T) {
	t.Parallel()
	for _, dir := range publicDirs {
		fset := token.NewFileSet()
		paths, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		var files []*ast.File
		for _, path := range paths {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		if len(files) == 0 {
			t.Fatalf("%s: no Go files", dir)
		}
		name := files[0].Name.Name
		for _, f := range files {
			ast.Inspect(f, func(n ast.Node) bool {
				if ts, ok := n.(*ast.TypeSpec); ok && ts.Assign.IsValid() && ts.Name.IsExported() {
					t.Errorf("package %s: type %s is an alias: give the package a type of its own", name, ts.Name.Name)
				}
				return true
			})
		}
		p, err := doc.NewFromFiles(fset, files, "github.com/pgidem/pgidem/"+name)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Doc) < 300 || (name == "idem" && !strings.Contains(p.Doc, "New(")) {
			t.Errorf("package %s: the overview is missing or has no wiring", name)
		}
		undocumented := func(kind, n, text string) {
			if strings.TrimSpace(text) == "" {
				t.Errorf("package %s: %s %s has no doc comment", name, kind, n)
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
				undocumented("func", typ.Name+"."+f.Name, f.Doc)
			}
			for _, v := range append(typ.Consts, typ.Vars...) {
				undocumented("const/var", strings.Join(v.Names, ", "), v.Doc)
			}
			for _, spec := range typ.Decl.Specs {
				ts := spec.(*ast.TypeSpec)
				var fields *ast.FieldList
				switch tt := ts.Type.(type) {
				case *ast.StructType:
					fields = tt.Fields
				case *ast.InterfaceType:
					fields = tt.Methods
				}
				if fields == nil {
					continue
				}
				documented := false // a comment covers the fields below it up to a blank line
				prevEnd := 0
				for _, f := range fields.List {
					if f.Doc != nil {
						documented = true
					} else if fset.Position(f.Pos()).Line > prevEnd+1 {
						documented = false
					}
					prevEnd = fset.Position(f.End()).Line
					for _, n := range f.Names {
						if n.IsExported() && !documented {
							t.Errorf("package %s: %s.%s has no doc comment", name, typ.Name, n.Name)
						}
					}
				}
			}
		}
	}
}
