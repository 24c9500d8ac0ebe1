//! Chat templates: a conversation rendered to the prompt text a model was trained on.
//!
//! Models carry a Jinja template (`tokenizer.chat_template` in GGUF, `chat_template` in
//! `tokenizer_config.json`), written for Python's `jinja2` as Hugging Face's
//! `apply_chat_template` runs it: blocks trimmed (`trim_blocks`, `lstrip_blocks`), loop controls,
//! Python string and dict methods (`.strip()`, `.startswith()`, `.items()`), and the globals
//! `raise_exception` and `strftime_now`, and a `tojson` that writes JSON as Python's `json.dumps`
//! does. Kiln renders them with minijinja set up the same way.
//!
//! ```
//! use kiln_engine::chat::{render, ChatMessage, CHATML_TEMPLATE};
//! let messages = [ChatMessage::new("user", "Hi")];
//! let prompt = render(CHATML_TEMPLATE, &messages, true, "", "")?;
//! assert_eq!(prompt, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
//! # Ok::<(), kiln_core::Error>(())
//! ```

use kiln_core::{Error, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::tokenizer::Tokenizer;

/// The ChatML template, used only for a model that carries no template of its own.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + \
message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may know others).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Renders `template` for `messages`. With `add_generation_prompt`, the text ends where the
/// assistant's answer starts. A template that does not parse or fails while rendering (including
/// its own `raise_exception`) is [`Error::ChatTemplate`] naming the line.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let env = environment();
    let compiled = env.template_from_str(template).map_err(template_error)?;
    compiled
        .render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(template_error)
}

/// Renders `messages` with the tokenizer's template and its BOS/EOS texts; a model without a
/// template gets [`CHATML_TEMPLATE`], and the fallback is logged.
pub fn render_with(
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<String> {
    let template = match tokenizer.chat_template() {
        Some(template) => template,
        None => {
            tracing::warn!("the model has no chat template; using ChatML");
            CHATML_TEMPLATE
        }
    };
    let text = |id: Option<u32>| id.and_then(|id| tokenizer.special_text(id)).unwrap_or("");
    render(template, messages, add_generation_prompt, text(tokenizer.bos_id()), text(tokenizer.eos_id()))
}

fn template_error(error: minijinja::Error) -> Error {
    let line = error.line().map_or_else(|| "unknown line".to_string(), |l| format!("line {l}"));
    let detail = error.detail().map_or_else(String::new, |d| format!(": {d}"));
    Error::ChatTemplate { reason: format!("{line}: {}{detail}", error.kind()) }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // As Hugging Face's `apply_chat_template` sets up jinja2.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> std::result::Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {message}")))
    });
    env.add_function("strftime_now", |format: String| -> std::result::Result<String, minijinja::Error> {
        strftime_utc(&format, unix_seconds())
    });
    env.add_filter("tojson", tojson);
    env
}

/// `tojson` as Hugging Face defines it: `json.dumps(value, ensure_ascii=False, indent=indent)`,
/// keys in their order (Python dicts keep insertion order; minijinja's `preserve_order` does too).
fn tojson(
    value: &Value,
    indent: Option<usize>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(i) => Some(i),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_python_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Writes `value` as Python's `json.dumps` does: `", "` and `": "` separators without indent,
/// `","` and newlines with it.
fn write_python_json(
    value: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    let json_error =
        |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    match value.kind() {
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            let is_map = value.kind() == ValueKind::Map;
            let (open, close) = if is_map { ('{', '}') } else { ('[', ']') };
            out.push(open);
            let mut empty = true;
            for (i, item) in value.try_iter()?.enumerate() {
                empty = false;
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                if is_map {
                    let key = item.as_str().map_or_else(|| item.to_string(), str::to_string);
                    out.push_str(&serde_json::to_string(&key).map_err(json_error)?);
                    out.push_str(": ");
                    write_python_json(&value.get_item(&item)?, indent, depth + 1, out)?;
                } else {
                    write_python_json(&item, indent, depth + 1, out)?;
                }
            }
            if !empty {
                newline(out, depth);
            }
            out.push(close);
        }
        _ => out.push_str(&serde_json::to_string(value).map_err(json_error)?),
    }
    Ok(())
}

fn unix_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `strftime` for the codes chat templates use, in UTC (Kiln reads no time zone database).
fn strftime_utc(format: &str, seconds: i64) -> std::result::Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = seconds.div_euclid(86_400);
    let secs = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let code = chars.next();
        let piece = match code {
            Some('Y') => year.to_string(),
            Some('y') => format!("{:02}", year.rem_euclid(100)),
            Some('m') => format!("{month:02}"),
            Some('d') => format!("{day:02}"),
            Some('e') => format!("{day:>2}"),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                day.to_string()
            }
            Some('H') => format!("{:02}", secs / 3600),
            Some('M') => format!("{:02}", secs % 3600 / 60),
            Some('S') => format!("{:02}", secs % 60),
            Some('B') => month_name.to_string(),
            Some('b') => month_name[..3].to_string(),
            Some('A') => DAYS[weekday].to_string(),
            Some('a') => DAYS[weekday][..3].to_string(),
            Some('j') => format!("{day_of_year:03}"),
            Some('%') => "%".to_string(),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: format code %{} is not served",
                        other.map_or(String::new(), String::from)
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// The proleptic Gregorian date of a day count from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_known_dates() -> Result<()> {
        // 2024-02-29 13:05:09 UTC, a Thursday (checked with `date -u -d @1709211909`).
        let t = 1_709_211_909;
        let s = strftime_utc("%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %-d %%", t)
            .map_err(|e| Error::ChatTemplate { reason: e.to_string() })?;
        assert_eq!(s, "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 29 %");
        assert_eq!(
            strftime_utc("%d %b %Y", 0).map_err(|e| Error::ChatTemplate { reason: e.to_string() })?,
            "01 Jan 1970"
        );
        assert!(strftime_utc("%Q", 0).is_err_and(|e| e.to_string().contains("%Q is not served")));
        Ok(())
    }

    #[test]
    fn syntax_error_names_the_line() {
        let err = render("line one\n{% if %}", &[], false, "", "").unwrap_err();
        let Error::ChatTemplate { reason } = &err else { panic!("expected ChatTemplate, got {err:?}") };
        assert!(reason.starts_with("line 2: syntax error"), "{reason}");
    }

    #[test]
    fn raise_exception_is_an_error_naming_its_message() {
        let template =
            "{% if messages[0]['role'] != 'user' %}\n{{ raise_exception('first must be user') }}{% endif %}";
        let err = render(template, &[ChatMessage::new("assistant", "x")], false, "", "").unwrap_err();
        let Error::ChatTemplate { reason } = &err else { panic!("expected ChatTemplate, got {err:?}") };
        assert!(reason.contains("raise_exception: first must be user"), "{reason}");
        assert!(reason.starts_with("line 2"), "{reason}");
    }

    #[test]
    fn python_string_methods_loop_controls_and_tojson() -> Result<()> {
        let template = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
            {{ m.content.strip().upper() }}{% if m.content.startswith(' a') %}!{% endif %}|{% endfor %}\
            {{ {'a': [1, 'é<'], 'b': none} | tojson }}";
        let messages =
            [ChatMessage::new("user", " abc "), ChatMessage::new("skip", "x"), ChatMessage::new("user", "d")];
        let out = render(template, &messages, false, "", "")?;
        // json.dumps({'a': [1, 'é<'], 'b': None}, ensure_ascii=False)
        assert_eq!(out, "ABC!|D|{\"a\": [1, \"é<\"], \"b\": null}");
        Ok(())
    }
}
