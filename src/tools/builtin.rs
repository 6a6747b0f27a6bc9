//! Built-in tools: `current_time` and `calculator`. Small, dependable, and always there.

use async_trait::async_trait;
use chrono::{FixedOffset, SecondsFormat, Utc};
use serde_json::{Value, json};

use super::{Tool, ToolCallContext, ToolError, ToolOutput, ToolSpec};

/// The built-in tool of that name, if there is one.
pub fn builtin(name: &str) -> Option<std::sync::Arc<dyn Tool>> {
    match name {
        "current_time" => Some(std::sync::Arc::new(CurrentTime)),
        "calculator" => Some(std::sync::Arc::new(Calculator)),
        _ => None,
    }
}

pub struct CurrentTime;

#[async_trait]
impl Tool for CurrentTime {
    fn name(&self) -> &str {
        "current_time"
    }

    /// Reads the clock: nothing to undo.
    fn idempotent(&self) -> bool {
        true
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name().into(),
            description: "The current date and time. Optionally at a UTC offset such as +02:00.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {"utc_offset": {"type": "string", "description": "e.g. +02:00 or -05:30; default UTC"}},
            }),
        }
    }

    async fn call(&self, input: Value, _ctx: ToolCallContext) -> Result<ToolOutput, ToolError> {
        let now = Utc::now();
        let offset = match input.get("utc_offset").and_then(Value::as_str) {
            None | Some("" | "Z" | "UTC") => FixedOffset::east_opt(0).expect("zero is a valid offset"),
            Some(text) => {
                text.parse::<FixedOffset>().map_err(|_| ToolError::new(format!("Invalid utc_offset '{text}'")))?
            }
        };
        let local = now.with_timezone(&offset);
        let text = json!({
            "iso": local.to_rfc3339_opts(SecondsFormat::Secs, false),
            "weekday": local.format("%A").to_string(),
            "unix": now.timestamp(),
        });
        Ok(ToolOutput { text: text.to_string(), payload: None })
    }
}

pub struct Calculator;

#[async_trait]
impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculator"
    }

    /// Computes: nothing to undo.
    fn idempotent(&self) -> bool {
        true
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name().into(),
            description: "Evaluates an arithmetic expression with + - * / ^ % and parentheses.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (2 + 3) * 4 ^ 2"}},
                "required": ["expression"],
            }),
        }
    }

    async fn call(&self, input: Value, _ctx: ToolCallContext) -> Result<ToolOutput, ToolError> {
        let expression =
            input.get("expression").and_then(Value::as_str).ok_or_else(|| ToolError::new("expression is required"))?;
        let value = evaluate(expression).map_err(ToolError::new)?;
        Ok(ToolOutput { text: format_number(value), payload: None })
    }
}

fn format_number(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 { format!("{}", value as i64) } else { format!("{value}") }
}

/// Evaluates `expression` by recursive descent: sum → product → unary → power → atom, so
/// `-2^2` is -4 and `2^3^2` is 2^9, as in mathematics.
pub fn evaluate(expression: &str) -> Result<f64, String> {
    let tokens: Vec<char> = expression.chars().filter(|c| !c.is_whitespace()).collect();
    let mut parser = Parser { tokens: &tokens, at: 0, depth: 0 };
    let value = parser.sum()?;
    if parser.at != tokens.len() {
        return Err(format!("Unexpected '{}' in expression", tokens[parser.at]));
    }
    if !value.is_finite() {
        return Err("The result is not a finite number".into());
    }
    Ok(value)
}

struct Parser<'a> {
    tokens: &'a [char],
    at: usize,
    depth: usize,
}

/// Nesting beyond this is refused: the parser recurses, and a stack overflow would take the
/// whole server down.
const MAX_DEPTH: usize = 100;

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.tokens.get(self.at).copied()
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.at += 1;
            let rhs = self.product()?;
            value = if op == '+' { value + rhs } else { value - rhs };
        }
        Ok(value)
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.unary()?;
        while let Some(op @ ('*' | '/' | '%')) = self.peek() {
            self.at += 1;
            let rhs = self.unary()?;
            if op != '*' && rhs == 0.0 {
                return Err("Division by zero".into());
            }
            value = match op {
                '*' => value * rhs,
                '/' => value / rhs,
                _ => value % rhs,
            };
        }
        Ok(value)
    }

    fn power(&mut self) -> Result<f64, String> {
        let base = self.atom()?;
        if self.peek() == Some('^') {
            self.at += 1;
            // Right-associative, and the exponent may be negative: 2^-1.
            return Ok(base.powf(self.unary()?));
        }
        Ok(base)
    }

    fn unary(&mut self) -> Result<f64, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err("The expression is nested too deeply".into());
        }
        let value = self.unary_inner();
        self.depth -= 1;
        value
    }

    fn unary_inner(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some('-') => {
                self.at += 1;
                Ok(-self.unary()?)
            }
            Some('+') => {
                self.at += 1;
                self.unary()
            }
            _ => self.power(),
        }
    }

    fn atom(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some('(') => {
                self.at += 1;
                let value = self.sum()?;
                if self.peek() != Some(')') {
                    return Err("Missing ')'".into());
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == '.' => {
                let start = self.at;
                while self.peek().is_some_and(|c| c.is_ascii_digit() || c == '.') {
                    self.at += 1;
                }
                let text: String = self.tokens[start..self.at].iter().collect();
                text.parse().map_err(|_| format!("Invalid number '{text}'"))
            }
            Some(c) => Err(format!("Unexpected '{c}' in expression")),
            None => Err("The expression ended too soon".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_follows_precedence() {
        assert_eq!(evaluate("2 + 3 * 4").unwrap(), 14.0);
        assert_eq!(evaluate("(2 + 3) * 4").unwrap(), 20.0);
        assert_eq!(evaluate("2 ^ 3 ^ 2").unwrap(), 512.0);
        assert_eq!(evaluate("-2 ^ 2").unwrap(), -4.0);
        assert_eq!(evaluate("2 ^ -1").unwrap(), 0.5);
        assert_eq!(evaluate("7 % 4 - 1.5").unwrap(), 1.5);
        assert_eq!(format_number(evaluate("10 / 4").unwrap()), "2.5");
    }

    #[test]
    fn bad_expressions_are_errors() {
        for bad in ["", "1 +", "(1", "1 / 0", "2 $ 3", "1..2"] {
            assert!(evaluate(bad).is_err(), "{bad}");
        }
        let deep = format!("{}1{}", "(".repeat(20_000), ")".repeat(20_000));
        assert_eq!(evaluate(&deep).unwrap_err(), "The expression is nested too deeply");
        assert!(evaluate(&"-".repeat(20_000)).is_err());
    }
}
