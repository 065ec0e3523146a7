"""The HCL reader and the checkov report judge, on small inputs."""

from __future__ import annotations

from ops.check.checkov_report import judge
from ops.check.hcl import Call, Ref, Template, parse_value, references


def test_references_count_code_and_interpolations_but_not_comments_or_plain_strings():
    text = '''
      # var.in_comment
      a = "${var.interpolated}-${lookup(var.nested, "k")}" /* var.in_block_comment */
      b = "mentions var.in_plain_string"
      c = var.plain // var.after_line_comment
      d = <<-EOT
        ${var.in_heredoc}
      EOT
    '''
    assert references(text, "var") == {"interpolated", "nested", "plain", "in_heredoc"}


def test_literal_objects_lists_and_references_are_read_as_values():
    value = parse_value('{ "nvidia.com/gpu" = var.tp, sizes = [1, 2.5, "x"], on = true, none = null }')
    assert value == {"nvidia.com/gpu": Ref(("var", "tp")), "sizes": [1, 2.5, "x"], "on": True, "none": None}
    assert parse_value('yamlencode({ a = "${var.b}" })') == Call("yamlencode", ({"a": Template("${var.b}")},))


def _report(**results):
    base = {"passed_checks": [], "failed_checks": [], "skipped_checks": [], "parsing_errors": []}
    base.update(results)
    return {"check_type": "terraform", "results": base, "summary": {"resource_count": 3, "parsing_errors": len(base["parsing_errors"])}}


def test_clean_checkov_report_has_no_problems():
    assert judge(_report(), ("terraform",)) == []


def test_checkov_parsing_errors_are_problems_even_though_checkov_exits_zero():
    problems = judge(_report(parsing_errors=["/m/bad.tf"]))
    assert problems == ["terraform: checkov could not parse /m/bad.tf"]


def test_failed_check_and_skip_without_reason_are_problems_and_skip_with_reason_is_not():
    failed = {"check_id": "CKV_X_1", "check_name": "x", "file_path": "/a.tf", "file_line_range": [3, 4], "resource": "r"}
    no_reason = {"check_id": "CKV_X_2", "file_path": "/a.tf", "resource": "r", "check_result": {"suppress_comment": "No comment provided"}}
    reason = {"check_id": "CKV_X_3", "file_path": "/a.tf", "resource": "r", "check_result": {"suppress_comment": " accepted: why"}}
    problems = judge(_report(failed_checks=[failed], skipped_checks=[no_reason, reason]))
    assert len(problems) == 2
    assert "CKV_X_1" in problems[0] and "CKV_X_2 skipped without a reason" in problems[1]


def test_framework_that_scanned_nothing_is_a_problem():
    empty = {"check_type": "dockerfile", "results": {}, "summary": {"resource_count": 0}}
    assert judge([empty], ("dockerfile",)) == ["dockerfile: checkov scanned no resources (nothing parsed?)"]
