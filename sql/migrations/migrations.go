// Package migrations carries the tern migrations of schema idem (the NNN_name.sql files of this
// directory, and under online/ the templates they share with the online steps that run beside
// them) and the schema version they bring a database to, without tern: package idem
// checks a database's version with it, and package idemsql (which imports tern) applies them.
package migrations

import (
	"embed"
	"io/fs"
	"regexp"
)

//go:embed *.sql online/*.sql
var files embed.FS

// FS is the migrations: the files named NNN_name.sql, as tern reads them.
func FS() fs.FS { return files }

// name is tern's pattern for a migration file.
var name = regexp.MustCompile(`\A(\d+)_.+\.sql\z`)

// Version is the schema version these migrations bring a database to: the number of
// migrations, which idem.schema_version holds once they have run (and idem.idem_version()
// reports for the schema and for the functions).
func Version() int {
	entries, _ := fs.ReadDir(files, ".")
	n := 0
	for _, e := range entries {
		if name.MatchString(e.Name()) {
			n++
		}
	}
	return n
}
