//! The tables and field lists devctl prints, on comfy-table: left-aligned columns two spaces
//! apart, no borders, no trailing blanks. Given the terminal's width, long cells wrap inside
//! their column (free text first: reasons, health, owners) so rows stay aligned; without one (a
//! pipe or a file) nothing wraps, so scripts and `grep` see one line per row.

use std::fmt;

use comfy_table::{presets, ColumnConstraint, ContentArrangement};

/// Spaces between two columns.
const GAP: u16 = 2;

/// A table with or without a header line.
#[derive(Debug, Clone)]
pub struct Table {
    table: comfy_table::Table,
    /// Columns that never wrap: identifiers people copy (fingerprints, UUIDs, names, times).
    whole: Vec<usize>,
}

impl Table {
    /// A table whose first line names the columns.
    pub fn new(headers: &[&str]) -> Self {
        let mut table = Self::bare();
        table.table.set_header(headers.to_vec());
        table
    }

    /// A table without a header line, like the `name:  value` lists of `show` commands.
    pub fn bare() -> Self {
        let mut table = comfy_table::Table::new();
        table.load_preset(presets::NOTHING);
        Self {
            table,
            whole: Vec::new(),
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.table
            .add_row(cells.into_iter().map(Into::into).collect::<Vec<String>>());
    }

    /// A `name:  value` line of a field list.
    pub fn field(&mut self, name: &str, value: impl Into<String>) {
        self.row([format!("{name}:"), value.into()]);
    }

    /// Keeps these columns (0-based) whole when the table is narrowed to the terminal.
    pub fn keep_whole(&mut self, columns: &[usize]) -> &mut Self {
        self.whole.extend_from_slice(columns);
        self
    }

    /// Renders each line prefixed by `indent`, wrapped to `width` columns when one is given.
    pub fn render(&self, width: Option<u16>, indent: &str) -> String {
        let mut table = self.table.clone();
        let columns = table.column_count();
        // comfy-table draws an empty column one blank wide: its gap is one blank shorter, so
        // the columns around it stay `GAP` + `GAP` apart, as with a zero-width column.
        let empty: Vec<bool> = (0..columns)
            .map(|i| {
                table
                    .column_cells_with_header_iter(i)
                    .all(|cell| cell.is_none_or(|cell| cell.content().is_empty()))
            })
            .collect();
        for (i, column) in table.column_iter_mut().enumerate() {
            let right = match (i + 1 < columns, empty[i]) {
                (false, _) => 0,
                (true, false) => GAP,
                (true, true) => GAP - 1,
            };
            column.set_padding((0, right));
            if self.whole.contains(&i) {
                column.set_constraint(ColumnConstraint::ContentWidth);
            }
        }
        if let Some(width) = width {
            let indent_width = u16::try_from(indent.chars().count()).unwrap_or(u16::MAX);
            table
                .set_width(width.saturating_sub(indent_width))
                .set_content_arrangement(ContentArrangement::Dynamic);
        }
        let mut out = String::new();
        for line in table.lines() {
            out.push_str(indent);
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Unwrapped, without indent: as printed into a pipe.
impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(None, ""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions() -> Table {
        let mut t = Table::new(&["NAME", "STATE", "REASON"]);
        t.row([
            "train1",
            "PENDING",
            "placed on node1 (GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f)",
        ]);
        t.row(["a", "WAITING", ""]);
        t
    }

    #[test]
    fn columns_align_without_trailing_blanks() {
        assert_eq!(
            sessions().to_string(),
            "NAME    STATE    REASON\n\
             train1  PENDING  placed on node1 (GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f)\n\
             a       WAITING\n"
        );
    }

    #[test]
    fn an_empty_column_keeps_its_gaps() {
        let mut t = Table::bare();
        t.row(["2026-11-21 10:00:03Z", "", "→ PENDING", "created"]);
        assert_eq!(
            t.to_string(),
            "2026-11-21 10:00:03Z    → PENDING  created\n"
        );
    }

    #[test]
    fn short_rows_and_indents() {
        let mut t = Table::bare();
        t.row(["node3", "(no GPUs)"]);
        t.row(["node1", "GPU-1", "A100"]);
        t.field("name", "local");
        assert_eq!(
            t.render(None, "  "),
            "  node3  (no GPUs)\n  node1  GPU-1      A100\n  name:  local\n"
        );
    }

    #[test]
    fn a_terminal_width_wraps_free_text_and_keeps_identifiers_whole() {
        let mut t = sessions();
        t.keep_whole(&[0, 1]);
        let text = t.render(Some(40), "");
        assert!(text.lines().all(|l| l.chars().count() <= 40), "{text}");
        assert_eq!(
            text.lines().next(),
            Some("NAME    STATE    REASON"),
            "columns stay aligned: {text}"
        );
        assert!(
            text.contains("\ntrain1  PENDING  placed on node1"),
            "{text}"
        );
        // The wrapped reason continues in its own column.
        assert!(
            text.lines()
                .nth(2)
                .unwrap()
                .starts_with("                 "),
            "{text}"
        );
        // Wide enough: the same as into a pipe.
        assert_eq!(sessions().render(Some(200), ""), sessions().to_string());
    }
}
